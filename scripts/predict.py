#!/usr/bin/env python
"""A PREDICTION, not a measurement: tokens/s against plain decoding for each method of a
benchmark run, on the hardware of a verification-cost curve.

    python scripts/predict.py --bench bench.json                       # cost: the bench's own CPU
                                                                       #   --draft-cost table
    python scripts/predict.py --bench bench.json --curve cost_curve.json [--attn triton] [--ctx 512]
    ... [--draft-ms lookahead=0.3 --draft-ms mamba=1.2] [--json prediction.json]

What it combines. Greedy acceptance does not depend on the hardware, so from the benchmark (see
scripts/bench.py) it takes, per method and category: tau = generated tokens per target step and
L = draft tokens verified per step (steps = generated - accepted). From the cost curve it takes the
time of a verification step of q = 1 + L query tokens per request at the benchmark's batch size
(linear interpolation in q between measured points; chain cells for chain methods, tree cells
for tree methods: bandit_tree, `"tree": true`), and of a plain step (q = 1). Then

    predicted speedup = tau * step(1) / (step(1 + L) + draft_ms)

draft_ms: the method's drafting time per step on the target hardware. The benchmark does not
record it, so it is 0 unless given with --draft-ms (then the prediction is a verification-only
upper bound, and is labelled so). On the benchmark's own machine (--curve omitted) the report
also prints the measured speedup and the drafting time per step that would close the gap
("implied draft ms"): the measured run's drafting share, not a check of the model.

Assumptions, printed with every prediction: every step of a method verifies its mean L (the
curve is not linear in q, so a spread of L per step moves the mean step cost; the benchmark
records only totals); the batch's requests step together (engine step = the batch); context =
the curve's context nearest --ctx; acceptance measured at the benchmark's batch size and
temperature carries over.
"""
from __future__ import annotations

import argparse
import json
import math
import sys


def is_tree(spec) -> bool:
    """Whether a speculative config drafts trees (our methods: their config's `uses_trees`)."""
    from vllm_spec_plugins.config import METHODS, from_params
    return isinstance(spec, dict) and spec.get("method") in METHODS and from_params(spec).uses_trees


def interp(points: dict[int, float], q: float) -> float:
    """Linear interpolation of step time over q (extrapolated from the two nearest ends)."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if q <= xs[0]:
        a, b = xs[0], xs[1]
    elif q >= xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(x for x in xs if x >= q)
        a = max(x for x in xs if x <= q)
        if a == b:
            return points[a]
    return points[a] + (points[b] - points[a]) * (q - a) / (b - a)


def curve_from_gpu(curve: dict, attn: str, batch: int, ctx: int) -> tuple[dict, dict, dict]:
    """{q: ms} for chain and tree cells of the (batch, ctx) nearest to the request, and what was used."""
    cells = [c for c in curve["cells"] if c.get("status") == "ok" and c.get("attn", "sdpa") == attn]
    if not cells:
        raise SystemExit(f"cost curve has no measured cells with attn={attn!r}")
    batches = sorted({c["batch"] for c in cells})
    b = min(batches, key=lambda x: (abs(math.log(x / batch)), x))
    ctxs = sorted({c["ctx"] for c in cells if c["batch"] == b})
    cx = min(ctxs, key=lambda x: abs(x - ctx))
    chain = {c["q_len"]: c["ms"] for c in cells if c["batch"] == b and c["ctx"] == cx and c["mask"] == "chain"}
    tree = {c["q_len"]: c["ms"] for c in cells if c["batch"] == b and c["ctx"] == cx and c["mask"] == "tree"}
    if 1 in chain:
        tree.setdefault(1, chain[1])
    return chain, tree, {"source": "gpu_check cost curve", "attn": attn, "batch": b, "ctx": cx,
                         "device": curve.get("env", {}).get("device"), "modes": sorted({c.get("mode") for c in cells})}


def curve_from_bench(bench: dict, cat: str) -> tuple[dict, dict, dict]:
    """The benchmark's own --draft-cost table (CPU: ms per step verifying L drafts, chain only),
    and --step-cost's tree/chain ratio for trees where present."""
    dc = (bench.get("draft_cost") or {}).get(cat)
    if not dc:
        raise SystemExit(f"the bench JSON has no draft_cost table for {cat!r}: run bench.py with --draft-cost "
                         "0,1,2,4,8 (or pass --curve)")
    chain = {int(n) + 1: r["ms"] for n, r in dc.items()}
    tree = {}
    sc = (bench.get("step_cost") or {}).get(cat)
    info = {"source": "bench draft_cost (this machine)", "batch": bench.get("config", {}).get("batch_size")}
    if sc:
        ratio = (sc.get("alternating") or {}).get("tree_over_chain", sc.get("tree_over_chain"))
        tree = {q: ms * (ratio if q > 1 else 1.0) for q, ms in chain.items()}
        info["tree_over_chain"] = ratio
    return chain, tree, info


def predict(bench: dict, curve: dict | None, attn: str, ctx: int, draft_ms: dict[str, float]) -> dict:
    results = bench["results"]
    configs = bench.get("config", {}).get("method_configs", {})
    batch = int(bench.get("config", {}).get("batch_size") or 1)
    out = {"label": "PREDICTION (not a measurement)", "batch_size": batch, "rows": [],
           "assumptions": [
               "tau and verified drafts per step (L) from the benchmark carry over (greedy acceptance is "
               "hardware independent)",
               "every step verifies the method's mean L (the benchmark records totals only)",
               "the batch's requests step together; step cost from the curve at that batch size",
               "draft_ms = 0 unless given: a verification-only upper bound",
           ]}
    for name, cats in results.items():
        if name == "plain" or name.endswith("_rejected") or name == "draft_cost":
            continue
        spec = configs.get(name)
        for cat, r in cats.items():
            steps = r["generated_tokens"] - r["accepted"]
            if steps <= 0:
                continue
            tau = r["generated_tokens"] / steps
            L = r["draft_tokens"] / steps
            tree = is_tree(spec)
            if curve is not None:
                chain_c, tree_c, info = curve_from_gpu(curve, attn, batch, ctx)
            else:
                chain_c, tree_c, info = curve_from_bench(bench, cat)
            pts = tree_c if (tree and tree_c) else chain_c
            q = 1 + L
            step_q, step_1 = interp(pts, q), interp(chain_c, 1)
            d = draft_ms.get(name, 0.0)
            pred = tau * step_1 / (step_q + d)
            row = {"method": name, "category": cat, "tau": tau, "verified_drafts_per_step": L,
                   "tree": tree, "tree_cost_used": bool(tree and tree_c), "step_ms_plain": step_1,
                   "step_ms_verify": step_q, "draft_ms": d, "predicted_speedup": pred,
                   "upper_bound": name not in draft_ms, "cost_source": info}
            if curve is None:
                meas = r.get("speedup_vs_plain")
                row["measured_speedup"] = meas
                if meas:
                    row["prediction_error"] = pred / meas - 1
                    row["implied_draft_ms"] = tau * step_1 / meas - step_q
            out["rows"].append(row)
    return out


def print_table(p: dict) -> None:
    print(f"\n{p['label']}, batch {p['batch_size']}")
    have_meas = any("measured_speedup" in r for r in p["rows"])
    head = "| method | category | tau | L/step | step ms (plain -> verify) | draft ms | predicted x |"
    if have_meas:
        head += " measured x | error | implied draft ms |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in p["rows"]:
        line = (f"| {r['method']} | {r['category']} | {r['tau']:.2f} | {r['verified_drafts_per_step']:.2f} | "
                f"{r['step_ms_plain']:.2f} -> {r['step_ms_verify']:.2f}{' (tree)' if r['tree_cost_used'] else ''} | "
                f"{r['draft_ms']:.2f} | {r['predicted_speedup']:.2f}{' (upper bound)' if r['upper_bound'] else ''} |")
        if have_meas:
            m = r.get("measured_speedup")
            line += (f" {m:.2f} | {r['prediction_error']:+.0%} | {r['implied_draft_ms']:.2f} |" if m
                     else " - | - | - |")
        print(line)
    print("assumptions: " + "; ".join(p["assumptions"]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="scripts/bench.py --json output")
    ap.add_argument("--curve", help="scripts/gpu_check.py cost_curve.json (default: the bench's own draft_cost)")
    ap.add_argument("--attn", default="triton", help="curve cells of this attention path (triton | sdpa)")
    ap.add_argument("--ctx", type=int, default=512, help="context of the curve cells to use (nearest)")
    ap.add_argument("--draft-ms", action="append", default=[], metavar="METHOD=MS",
                    help="drafting time per step on the target hardware")
    ap.add_argument("--json", help="write the prediction here")
    a = ap.parse_args(argv)
    a.draft_ms = {k: float(v) for k, _, v in (x.partition("=") for x in a.draft_ms)}
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    with open(a.bench) as f:
        bench = json.load(f)
    curve = None
    if a.curve:
        with open(a.curve) as f:
            curve = json.load(f)
    p = predict(bench, curve, a.attn, a.ctx, a.draft_ms)
    print_table(p)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(p, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
