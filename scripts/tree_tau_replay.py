"""Offline tau of draft-tree shapes for the Mamba drafter, from a bench run's plain outputs.

For `bandit_tree`'s Mamba trees (the drafter's greedy chain, and at each depth its next-best tokens
as leaves under the chain's node above) greedy acceptance depends only on the rank of the
target's token among the drafter's top tokens at each position, given the true prefix; one
teacher-forced drafter pass per answer gives every shape's tau. Answers are re-tokenized from the
bench JSON's text (nearly, not exactly, the target's token ids), drafter in float32.

    python scripts/tree_tau_replay.py out/s26/bt_b1_wide.json --shapes 1-1-1,3-1,4-2-1,6-2-2
"""
import argparse
import json

import torch


def tau(shape: tuple, ranks: list[list[int]]) -> float:
    steps = made = 0
    for r in ranks:
        p = 0
        while p < len(r):
            a = 0
            for i, w in enumerate(shape):
                if p + i >= len(r):
                    break
                if r[p + i] == 0:            # the chain's token
                    a += 1
                    continue
                a += r[p + i] < w            # a leaf: accepted, and the path ends there
                break
            steps, made, p = steps + 1, made + a + 1, p + a + 1
    return made / max(steps, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json")
    p.add_argument("--shapes", default="1-1,1-1-1,1-1-1-1,3-1,4-2,6-2,3-1-1,4-2-1,6-2-2,6-3-1,8-4-2-1")
    p.add_argument("--method", default="plain", help="whose outputs to replay")
    p.add_argument("--drafter", default="vllm_spec_plugins:smollm2-135m-instruct-mamba")
    args = p.parse_args()
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from vllm_spec_plugins.config import resolve_shipped_drafter
    from vllm_spec_plugins.proposers.mamba import load_drafter
    from vllm_spec_plugins.tools import data
    from vllm_spec_plugins.tools.runner import to_token_prompts
    bench = json.load(open(args.bench_json))
    cfg, outs = bench["config"], bench["outputs"][args.method]
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    w = load_file(f"{cfg['model']}/model.safetensors")
    emb = w["model.embed_tokens.weight"].float()
    d = load_drafter(resolve_shipped_drafter({"model": args.drafter})["model"], emb,
                     w.get("lm_head.weight", emb).float())
    rows = data.read_jsonl(cfg["prompts"]) if cfg["prompts"] else data.make_prompts(
        categories=tuple(outs), n_per_category=cfg["n_per_category"], split="heldout")
    shapes = [tuple(int(x) for x in s.split("-")) for s in args.shapes.split(",")]
    W = max(max(s) for s in shapes)
    print("| shape | nodes | " + " | ".join(f"tau {c}" for c in outs) + " |\n|---|---|" + "---|" * len(outs))
    res = {}
    for cat, texts in outs.items():
        prompts = to_token_prompts(tok, [r for r in rows if r.get("category", "all") == cat])
        ranks = []
        for pr, o in zip(prompts, texts):
            seq = pr + tok.encode(o[0] if isinstance(o, list) else o, add_special_tokens=False)
            with torch.no_grad():
                h, _ = d(torch.tensor([seq]))        # the drafter's top W at the answer's positions only
                top = d.draft_vocab[d.logits(h[0, len(pr):-1]).topk(W, -1).indices]
            hit = top == torch.tensor(seq[len(pr) + 1:]).unsqueeze(1)
            ranks.append(torch.where(hit.any(1), hit.float().argmax(1), W).tolist())
        res[cat] = {s: tau(s, ranks) for s in shapes}
    for s in shapes:
        print(f"| {'-'.join(map(str, s))} | {sum(s)} | " + " | ".join(f"{res[c][s]:.3f}" for c in outs) + " |")


if __name__ == "__main__":
    main()
