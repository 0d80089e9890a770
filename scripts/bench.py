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
    # vLLM's own draft_model with the target's first 6 layers (no training: a baseline);
    # the drafter folder is built on first use.
    "draft_model": lambda model: {"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": str(__import__("vllm_spec_plugins.models", fromlist=["x"])
                                               .build_truncated_model(model, 6))},
}
# bf16 logits of magnitude 16..32 are spaced 0.125 apart: a top-2 margin of a few such steps
# is within the rounding that a different kernel shape (verifying k tokens) produces.
NEAR_TIE = 0.5


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
    if "plain" not in out:
        out = {"plain": None, **out}
    return out


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


def classify_mismatches(results, plain_lp, dtype):
    """bf16: top-2 margin of the target (plain run, logprobs=2) at the first differing token."""
    for name, cats in results.items():
        for cat, row in cats.items():
            diffs = row.pop("_first_diff", None)
            if not diffs or row.get("identical_to_plain", True):
                continue
            notes = []
            for i, d in enumerate(diffs):
                if d is None:
                    continue
                margin = None
                if plain_lp is not None:
                    lps = plain_lp["groups"][cat]["logprobs"][i][0]
                    if d < len(lps):
                        vals = sorted(lps[d].values(), reverse=True)
                        margin = vals[0] - vals[1] if len(vals) > 1 else None
                if dtype == "float32":
                    kind = "BUG"        # float32 must be exact
                elif margin is None:
                    kind = "unknown"
                else:
                    kind = "near-tie" if margin <= NEAR_TIE else "BUG"
                notes.append({"prompt": i, "first_diff_token": d, "top2_margin": margin, "kind": kind})
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


def main(argv=None):
    args = parse_args(argv)
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
    env = {"OMP_NUM_THREADS": str(args.threads)}
    raw = {}
    bar = tqdm(configs.items(), desc="bench", unit="method")
    for name, spec in bar:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        raw[name] = run_isolated({**base, "speculative_config": spec}, env=env)
        raw[name]["wall_s"] = time.perf_counter() - t0
    results = {name: summarize(r, raw["plain"], greedy) for name, r in raw.items()}
    plain_lp = None
    mismatch = any(not row.get("identical_to_plain", True) for rows in results.values() for row in rows.values())
    if greedy and mismatch:
        plain_lp = run_isolated({**base, "speculative_config": None, "logprobs": 2}, env=env)
    classify_mismatches(results, plain_lp, args.dtype)
    out = {"results": results,
           "config": {k: v for k, v in vars(args).items()} | {"model": model,
                                                                "method_configs": configs,
                                                                "n_prompts": {c: len(g) for c, g in groups.items()}},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0]},
           "outputs": {name: {c: g["texts"] for c, g in r["groups"].items()} for name, r in raw.items()}}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print_table(results, cats)
    png = args.plot or os.path.splitext(args.json)[0] + ".png"
    plot(results, cats, png, f"batch {args.batch_size}, {args.dtype}, T={args.temperature}, "
                             f"{args.max_tokens} tokens")
    print(f"\nwrote {args.json} and {png}")
    return out


if __name__ == "__main__":
    main()
