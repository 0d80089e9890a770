#!/usr/bin/env python
"""Write a deterministic prompt set (JSONL rows {"category", "messages", "id"}).

    python scripts/make_prompts.py --split heldout --n 8 --out prompts/heldout.jsonl
    python scripts/make_prompts.py --split fresh --n 0 --out prompts/fresh.jsonl

The heldout split is for evaluation only; never train on it. Held-out prompts whose normalised
text is in the training split are dropped. `fresh`: prompts written for the benchmark, never tuned
on (categories chat, code, repetitive; vllm_spec_plugins/assets/prompts/fresh.json).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

try:
    from vllm_spec_plugins.tools.data import CATEGORIES, FRESH_CATEGORIES, fresh_prompts, make_prompts, write_jsonl
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_spec_plugins.tools.data import CATEGORIES, FRESH_CATEGORIES, fresh_prompts, make_prompts, write_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="heldout", choices=["heldout", "train", "all", "fresh"])
    ap.add_argument("--n", type=int, default=8, help="prompts per category (0 = all)")
    ap.add_argument("--categories", default=None,
                    help=f"comma-separated subset of {','.join(CATEGORIES)} (fresh: {','.join(FRESH_CATEGORIES)}); "
                         "default all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="drop prompts longer than this (chat template applied)")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="tokenizer for --max-prompt-tokens (default: the built default model)")
    ap.add_argument("--out", required=True, help="output .jsonl path")
    args = ap.parse_args(argv)

    default = FRESH_CATEGORIES if args.split == "fresh" else CATEGORIES
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else list(default)
    if args.split == "fresh":
        rows = fresh_prompts(cats, args.n if args.n > 0 else None)
    else:
        rows = make_prompts(
            categories=cats,
            n_per_category=args.n if args.n > 0 else None,
            split=args.split,
            seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens,
            tokenizer_dir=args.tokenizer_dir,
        )
    path = write_jsonl(rows, args.out)
    counts = collections.Counter(r["category"] for r in rows)
    print(f"wrote {len(rows)} prompts ({dict(counts)}) split={args.split} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
