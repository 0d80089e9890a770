"""One benchmark for every method, side by side in one invocation, on the same prompts.

    python scripts/bench.py --methods plain,ngram,lookahead --prompts P.jsonl --max-tokens 64 \
        --temperature 0 --batch-size 1 --json out.json [--method-config NAME=JSON ...]

Each method runs in its own process (same prompts, same settings). Per category it reports
tokens/s, speedup vs plain, tau (generated tokens per target step), per-position acceptance from
vLLM's own vllm:spec_decode_* counters, and (greedy) whether the output equals plain vLLM's.
In bf16 a mismatch is classified: the target's top-2 logprob margin at the first differing token
tells a numerical near-tie from a bug.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEFAULT_CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 6},
    "lookahead_tree": {"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "ngram": 4, "tree": True},
    "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 16},
    # vLLM's own draft_model with the target's first 6 layers (no training: a baseline);
    # the drafter folder is built on first use.
    "draft_model": lambda model: {"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": str(__import__("vllm_spec_plugins.models", fromlist=["x"])
                                               .build_truncated_model(model, 6))},
    # vLLM's own EAGLE with the drafter this project trains for SmolLM2-135M-Instruct
    # (python -m vllm_spec_plugins.drafters; shipped in vllm_spec_plugins/assets/)
    "eagle": lambda model: {"method": "eagle", "num_speculative_tokens": 4,
                            "model": str(__import__("vllm_spec_plugins.drafters", fromlist=["x"])
                                         .shipped_drafter())},
    # the plugin's Mamba drafter trained for SmolLM2-135M-Instruct (shipped)
    "mamba": {"method": "mamba", "num_speculative_tokens": 4, "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
    # n-gram lookup drafts for that Mamba drafter, which drafts for the target
    "cascade": {"method": "cascade", "num_speculative_tokens": 8, "drafter_steps": 3,
                "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
}
# bf16 logits of magnitude 16..32 are spaced 0.125 apart: a top-2 margin of a few such steps
# is within the rounding that a different kernel shape (verifying k tokens) produces. The margin
# is a difference of float32 logprobs: exactly 4 steps can come back as 0.50000006.
NEAR_TIE = 0.5
NEAR_TIE_TOL = 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", default="plain,ngram,lookahead",
                   help="comma list; names from --method-config or " + ", ".join(DEFAULT_CONFIGS))
    p.add_argument("--method-config", action="append", default=[], metavar="NAME=JSON",
                   help="speculative_config for NAME (JSON object, or 'null' for plain)")
    p.add_argument("--prompts", help="jsonl rows {category, prompt|messages}; default: held-out set")
    p.add_argument("--n-per-category", type=int, default=6, help="when --prompts is omitted")
    p.add_argument("--categories", default="chat,code,summarize", help="when --prompts is omitted")
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
    p.add_argument("--warm-batch", type=int, default=0, metavar="B",
                   help="serve the --warm prompts B at a time (default: --batch-size); the engine then has "
                        "max(B, --batch-size) request slots and admits --batch-size at a time while measured")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="keep one engine per method up and serve N prompts to each in turn (rotating which "
                        "goes first), category by category: the host's speed drift hits every method alike "
                        "(engines get 1 GiB of KV cache each; replaces --repeats and the second plain run)")
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
    return p.parse_args(argv)


def method_configs(args, model: str) -> dict:
    configs = dict(DEFAULT_CONFIGS)
    for item in args.method_config:
        name, _, js = item.partition("=")
        if not js:
            raise SystemExit(f"--method-config {item!r}: expected NAME=JSON")
        configs[name] = json.loads(js)
    out = {}
    for name in args.methods.split(","):
        if name not in configs:
            raise SystemExit(f"unknown method {name!r}: give --method-config {name}=JSON "
                             f"(known: {', '.join(configs)})")
        out[name] = configs[name](model) if callable(configs[name]) else configs[name]
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
    for name in args.sweep:
        spec = out.get(name)
        if not spec or spec.get("method") != "bandit_tree":
            raise SystemExit(f"--sweep {name}: not a bandit_tree method of this run")
        for shape in bandit_family(spec):
            out[f"{name}@{shape_name(shape)}"] = {**spec, "shapes": [list(shape)]}
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
    from vllm_spec_plugins.proposers.bandit import shape_family
    p = validate(resolve_shipped_drafter(spec))
    if p["shapes"]:
        return [tuple(x) for x in p["shapes"]]
    return shape_family(p["max_depth"], p["max_width"], p["node_budget"], p["backoff"])


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
            print(f"| {cat} | {l0} -> mamba | {n['proposed']} | {n['kept_by_drafter']} ({n['drafter_acceptance']:.2f}) | "
                  f"{n['time_share']:.1%} |")
            print(f"| {cat} | {l0} tokens -> target | {n['to_target']} | {n['accepted_by_target']} "
                  f"({n['target_acceptance']:.2f}) | |")
            print(f"| {cat} | mamba -> target | {m['to_target']} | {m['accepted_by_target']} ({m['target_acceptance']:.2f}) | "
                  f"{m['time_share']:.1%} |")
            print(f"| {cat} | target | | | {lv['target']['time_share']:.1%} |")


def load_groups(args) -> dict:
    from vllm_spec_plugins import data
    if args.prompts:
        rows = data.read_jsonl(args.prompts)
    else:
        rows = data.make_prompts(categories=tuple(args.categories.split(",")),
                                 n_per_category=args.n_per_category, split="heldout")
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r.get("category", "all"), []).append(r)
    return groups


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(res: dict, plain: dict, greedy: bool) -> dict:
    out = {}
    for cat, g in res["groups"].items():
        p = plain["groups"][cat]
        drafts = g["drafts"]
        row = {k: g[k] for k in ("tokens_per_s", "tau", "drafts", "draft_tokens", "accepted",
                                 "generated_tokens", "seconds")}
        row["speedup_vs_plain"] = g["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0
        row["acceptance_per_position"] = [a / drafts for a in g["accepted_per_pos"]] if drafts else []
        row["acceptance_rate"] = g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else 0.0
        if greedy:
            diffs = [first_diff(a[0], b[0]) for a, b in zip(g["outputs"], p["outputs"])]
            row["identical_to_plain"] = all(d is None for d in diffs)
            row["mismatched_prompts"] = [i for i, d in enumerate(diffs) if d is not None]
            row["_first_diff"] = diffs
        out[cat] = row
    return out


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
            ident = "-" if ident is None else ("yes" if ident else
                                               "no (" + ",".join(m["kind"] for m in r.get("mismatch_analysis", [])) + ")")
            print(f"| {name} | {cat} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x | "
                  f"{r['tau']:.2f} | {r['acceptance_rate']:.2f} | {pp} | {ident} |")


ENGINE_GIB = 2.2   # one interleaved CPU engine of the 135M target, 1 GiB KV cache (measured: 10 used ~22 GiB)


def warn_memory(engines: int, meminfo: str = "/proc/meminfo") -> bool:
    """--interleave keeps every engine up at once: say so before minutes of start-up end in
    vLLM's "available memory ... less than requested" on the last engine. True if warned."""
    try:
        avail = next(int(l.split()[1]) for l in open(meminfo) if l.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return False
    if engines * ENGINE_GIB <= avail:
        return False
    print(f"warning: --interleave starts {engines} engines at once, ~{ENGINE_GIB} GiB each here "
          f"({engines * ENGINE_GIB:.0f} GiB), and {avail:.1f} GiB is available: the last ones may fail "
          f"to allocate their KV cache; run fewer methods (or --sweep shapes) per invocation", file=sys.stderr)
    return True


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


def run_interleaved(jobs: dict, groups: dict, n: int, env: dict, tqdm) -> dict:
    """`run_isolated`'s results for every job, measured in turns: all engines up (and warmed),
    then for each turn of n prompts of a category every engine serves them, the first engine
    rotating from turn to turn."""
    from vllm_spec_plugins.runner import EngineProcess, merge_groups
    engines: dict = {}
    try:
        for name, j in tqdm(jobs.items(), desc="engines up", unit="engine"):
            engines[name] = EngineProcess({**j, "groups": {}}, env=env)
        turns = [(cat, rows[i:i + n]) for cat, rows in groups.items() for i in range(0, len(rows), n)]
        names, got = list(jobs), {name: {} for name in jobs}
        for t, (cat, rows) in enumerate(tqdm(turns, desc="turns", unit="turn")):
            for name in names[t % len(names):] + names[:t % len(names)]:
                g = engines[name].group(cat, rows)
                got[name][cat] = merge_groups(got[name][cat], g) if cat in got[name] else g
        return {name: engines.pop(name).finish() | {"groups": got[name]} for name in names}
    finally:
        for e in engines.values():
            e.close()


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)   # before minutes of runs
    from tqdm import tqdm

    from vllm_spec_plugins.runner import run_isolated
    model = args.model
    if model is None:
        from vllm_spec_plugins.models import build_default_model
        model = str(build_default_model())
    configs = method_configs(args, model)
    groups = load_groups(args)
    cats = list(groups)
    greedy = args.temperature == 0.0
    base = {"model": model, "groups": groups, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "batch_size": args.batch_size, "dtype": args.dtype,
            "seed": args.seed, "sample_seed": args.seed if not greedy else None,
            "max_model_len": args.max_model_len,
            "llm_kwargs": {"enforce_eager": True} if args.eager else {}}
    if args.warm:
        from vllm_spec_plugins import data
        base["warm"] = data.make_prompts(categories=cats, n_per_category=args.warm, split="train")
        base["warm_batch"] = args.warm_batch
    base["tag_category"] = True      # extra_args={"category": ...}: bandit_tree's scope may key on it
    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": args.omp_wait_policy or None}
    raw = {}
    runs = list(configs.items()) * args.repeats + ([] if args.no_plain_rerun or args.repeats > 1
                                                   else [("plain (again)", None)])
    speeds: dict[str, dict[str, list[float]]] = {}
    def job(spec):
        return {**base, "speculative_config": spec, "report_plugin_state": is_bandit(spec),
                "report_plugin_stats": wants_stats(spec)}
    if args.interleave:
        if args.repeats > 1:
            raise SystemExit("--interleave replaces --repeats: give one of them")
        warn_memory(len(configs))
        raw = run_interleaved({name: job(spec) for name, spec in configs.items()}, groups, args.interleave,
                              env | {"VLLM_CPU_KVCACHE_SPACE": "1"}, tqdm)
        runs = []
    bar = tqdm(runs, desc="bench", unit="run") if runs else []
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
    cost = step_cost(results, raw, args.step_cost) if args.step_cost else None
    dcost = draft_cost(raw, configs["draft_cost"]["cycle"]) if args.draft_cost else None
    plain_lp = None
    mismatch = any(not row.get("identical_to_plain", True) for rows in results.values() for row in rows.values())
    if greedy and mismatch:
        plain_lp = run_isolated({**base, "speculative_config": None, "logprobs": 2}, env=env)
    classify_mismatches(results, plain_lp, args.dtype, raw["plain"])
    out = {"results": results,
           "config": {k: v for k, v in vars(args).items()} | {"model": model,
                                                                "method_configs": configs,
                                                                "n_prompts": {c: len(g) for c, g in groups.items()}},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0]},
           "outputs": {name: {c: g["texts"] for c, g in r["groups"].items()} for name, r in raw.items()},
           "bandit": {name: {"state": r["bandit_state"], "group_start_step": r.get("group_start_step")}
                      for name, r in raw.items() if "bandit_state" in r},
           "step_cost": cost, "draft_cost": dcost}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print_table(results, cats)
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
                             f"{args.max_tokens} tokens" + (f", after {args.warm} warm-up prompts per category"
                                                            if args.warm else "")
         + (f", interleaved ({args.interleave} a turn)" if args.interleave else ""))
    for name in results:
        if "bandit_state" in raw.get(name, {}):
            bpng = os.path.splitext(png)[0] + f"_{name.replace('@', '_')}.png"
            plot_bandit(raw[name], bpng, f"{name}: batch {args.batch_size}, {args.dtype}")
            print(f"wrote {bpng}")
            if any(n.startswith(name + "@") for n in results):
                spng = os.path.splitext(png)[0] + f"_{name}_sweep.png"
                plot_sweep(results, name, cats, spng, f"{name} and its fixed shapes: batch {args.batch_size}, {args.dtype}")
                print(f"wrote {spng}")
    print(f"\nwrote {args.json} and {png}")
    return out


if __name__ == "__main__":
    main()
