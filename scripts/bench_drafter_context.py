"""Drafter memory per request and drafting time per token vs context length: the Mamba drafter
(fixed-size state) against the Transformer drafter of the same size (KV cache), both as the
plugin runs them (plain torch, float32, batch 1, this machine's threads).

    python scripts/bench_drafter_context.py --out out/drafter_context.json --plot docs/drafter_context.png
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def measure(path: str, target: str, contexts: list[int], k: int, repeats: int) -> list[dict]:
    from vllm_spec_plugins.proposers.mamba import load_drafter, target_embeddings
    d = load_drafter(path, *target_embeddings(target))
    V = d.embed.shape[0]
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for n in contexts:
            ids = torch.randint(0, V, (1, n), generator=g)
            h, st = d(ids)                       # the prompt: one parallel pass
            h = h[:, -1]
            mem = d.state_nbytes(st)
            times = []
            for _ in range(repeats):             # k drafted tokens, each one recurrent step + head
                s, hh = st, h
                t0 = time.perf_counter()
                for _ in range(k):
                    t = d.draft_vocab[d.logits(hh).argmax(-1)]
                    hh, s = d.step(t, s)
                times.append((time.perf_counter() - t0) / k)
            times.sort()
            rows.append({"context": n, "state_bytes": mem, "ms_per_token": 1e3 * times[len(times) // 2]})
    return rows


def main() -> int:
    from vllm_spec_plugins.tools.drafters import random_ssm_drafter
    from vllm_spec_plugins.tools.models import default_model_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--mamba", default=None,
                    help="Mamba drafter folder (default: an untrained one of the shipped shape)")
    ap.add_argument("--transformer", default=None,
                    help="Transformer drafter folder (default: untrained, same shape as trained)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="out/drafter_context.json")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    target = a.target or str(default_model_dir())
    tmp = Path(a.out).parent / "drafter_context_models"
    paths = {"mamba": a.mamba or random_ssm_drafter(target, tmp / "mamba", kind="mamba"),
             "transformer": a.transformer or random_ssm_drafter(target, tmp / "transformer", kind="transformer")}
    contexts = [int(c) for c in a.contexts.split(",")]
    res = {"threads": torch.get_num_threads(), "k": a.k, "results": {}}
    try:
        from tqdm import tqdm
        it = tqdm(paths.items(), desc="drafters")
    except ImportError:
        it = paths.items()
    for kind, p in it:
        res["results"][kind] = measure(str(p), target, contexts, a.k, a.repeats)
    for kind, rows in res["results"].items():
        for r in rows:
            print(f"{kind:12s} context {r['context']:5d}: state {r['state_bytes'] / 2**20:7.2f} MiB, "
                  f"{r['ms_per_token']:6.2f} ms/drafted token")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
        for kind, rows in res["results"].items():
            x = [r["context"] for r in rows]
            ax[0].plot(x, [r["state_bytes"] / 2**20 for r in rows], "o-", label=kind)
            ax[1].plot(x, [r["ms_per_token"] for r in rows], "o-", label=kind)
        ax[0].set(xlabel="context (tokens)", ylabel="drafter state per request (MiB)", xscale="log")
        ax[1].set(xlabel="context (tokens)", ylabel="drafting time per token (ms)", xscale="log")
        for x in ax:
            x.set_xticks(contexts, [str(c) for c in contexts])
            x.legend()
        fig.tight_layout()
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=90)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
