"""Offline: a bench run's plain greedy outputs replayed through a model-free proposer on the toy
engine, with a step priced by a cost model instead of a model; the set's time against plain's.

Every step the target "returns" plain's next token where the prefix is plain's text (and noise
elsewhere, so the Jacobi window learns nothing real: `lookahead` is replayed without what its own
iterations would add). A step costs `--step-ms` + `--token-ms` per token it runs (rows + drafts)
past the first `--knee` + `--jump-ms` when it verifies any draft, on a simulated clock that goodput measures as it would
a real one; with `--proposer-time` also the proposal's own seconds, measured here (Python
lookups cost a model-free proposer of ours ~70 us a row at batch 8, which moves goodput's cut;
arctic-inference's suffix tree costs a few). As in the plugin, no draft past a request's
max_tokens is verified. Each category is replayed on a fresh proposer; with `--sequence` one
proposer serves them in turn, as bench.py's engines do, so state kept across requests (the
shared n-gram table, goodput's rates, bandit tables) carries over: replay anything cross-request
that way, a change that helps each category alone can hurt the next. A tuning tool for what
drafts: no speed claim comes from it (`bench.py` makes those). Prompts are rebuilt from the
run's own command line, answers re-tokenized from its text. `--noise` scales each step's seconds
by seeded lognormal noise: a bandit's arm choice replays as served only with it (a clean clock
never showed `bandit_tree` holding "no speculation" through a category; 20% noise did).

    python scripts/bench.py --prompts heldout --n-per-category 24 --methods plain --no-plain-rerun \\
        --dtype float32 --batch-size 8 --json out/heldout_plain.json
    python scripts/goodput_replay.py out/heldout_plain.json --batch-size 8 --methods suffix,lookahead
    python scripts/goodput_replay.py out/heldout_plain.json --batch-size 8 --methods bandit_tree --sequence \
        --noise 0.2 --seed 1
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Clock:
    """The simulated clock steps advance; goodput reads it as `time.perf_counter`. While `live`
    (a proposal timed for real, `--proposer-time`), the real seconds since then run on it."""

    t = 0.0
    live: float | None = None

    def __call__(self) -> float:
        return self.t if self.live is None else self.t + time.perf_counter() - self.live


def suffix_proposer():
    """vLLM's `suffix` method as its proposer drives arctic-inference, with vLLM's defaults (its
    `SpeculativeConfig`'s; k defaults to the tree depth there)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from vllm.config import SpeculativeConfig

    from vllm_spec_plugins.proposers.base import Proposer

    fields = SpeculativeConfig.__dataclass_fields__
    cfg = {k.removeprefix("suffix_decoding_"): f.default for k, f in fields.items()
           if k.startswith("suffix_decoding_")}
    depth = cfg["max_tree_depth"]

    class Suffix(Proposer):
        def __init__(self):
            super().__init__(depth)
            self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cfg["max_cached_requests"])
            self.fed, self.prompt_len = {}, {}

        def propose(self, ctx):
            out = []
            for r in ctx.requests:
                t = r.token_ids
                if r.req_id not in self.cache.active_requests:
                    n = self.prompt_len[r.req_id]
                    self.cache.start_request(r.req_id, np.asarray(t[:n], dtype=np.int32))
                    self.fed[r.req_id] = n
                if len(t) > self.fed[r.req_id]:
                    self.cache.add_active_response(r.req_id, t[self.fed[r.req_id]:].tolist())
                self.fed[r.req_id] = len(t)
                d = self.cache.speculate(r.req_id, np.asarray(t[-depth:], dtype=np.int32), max_spec_tokens=self.k,
                                         max_spec_factor=cfg["max_spec_factor"], min_token_prob=cfg["min_token_prob"])
                out.append(list(d.token_ids))
            for rid in self.cache.active_requests - {r.req_id for r in ctx.requests}:
                self.cache.stop_request(rid)
            return out

    return Suffix()


def replay(method: str, sets: list, batch: int, cost: tuple, params: dict,
           proposer_time: bool = False, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Serve each (prompts, answers) of `sets` in turn, `batch` at a time, through one `method`
    proposer (state shared across requests carries from one set to the next, as on a server that
    serves them in that order), the target answering `answers`. Per set: its seconds, tau and the
    fraction of drafted tokens accepted.
    `proposer_time`: each step also costs the proposer's own seconds, measured here (as a step of
    the plugin does, and as goodput measures them), not only the cost model's.
    `noise`: each step's modelled seconds times exp(N(0, noise)) (seeded), as served steps vary:
    a bandit that holds one arm on a clean clock may drift off it on a served one."""
    from vllm_spec_plugins.config import from_params
    from vllm_spec_plugins.proposers.base import BuildEnv, Proposer
    from vllm_spec_plugins.proposers.testing import ToyEngine

    table = {}
    for prompts, answers in sets:
        for p, a in zip(prompts, answers):
            for i in range(len(a)):
                table[tuple(p) + tuple(a[:i])] = a[i]
    clock = Clock()
    if method == "plain":
        prop = Proposer(1)
        prop.propose = lambda ctx: [[] for _ in ctx.requests]
    elif method == "suffix":
        prop = suffix_proposer()
    else:
        prop = from_params({"method": method, **params}).build(BuildEnv(vocab_size=params.get("vocab_size")))
        prop.clock = clock          # a proposer passes its clock on to what it wraps or drafts with
    if proposer_time:
        untimed = prop.propose

        def timed(ctx):
            clock.live = time.perf_counter()
            try:
                return untimed(ctx)
            finally:
                clock.t, clock.live = clock(), None
        prop.propose = timed
    eng = ToyEngine(prop, lambda prefix: table.get(prefix, hash(prefix) % 40000 + 5000))
    step_s, token_s, jump_s, knee = cost
    rng = np.random.default_rng(seed)
    out = []
    for s, (prompts, answers) in enumerate(sets):
        ids = [f"s{s}r{j}" for j in range(len(prompts))]
        if method == "suffix":
            prop.prompt_len.update({rid: len(p) for rid, p in zip(ids, prompts)})
        queue = list(zip(ids, prompts, answers))
        t0, drafted = clock.t, 0
        while queue or eng.reqs:
            while queue and len(eng.reqs) < batch:
                rid, p, a = queue.pop(0)
                eng.add(rid, p, len(a))
            n = sum(len(r.drafts or []) for r in eng.reqs.values())
            drafted += n
            dt = step_s + token_s * max(len(eng.reqs) + n - knee, 0) + (jump_s if n else 0.0)
            clock.t += dt * (float(np.exp(rng.normal(0.0, noise))) if noise else 1.0)
            eng.step()
            for r in eng.reqs.values():     # as the plugin: no draft past max_tokens is verified
                if isinstance(r.drafts, list):
                    r.drafts = r.drafts[:max(r.max_tokens - len(r.out) - 1, 0)]
        done = [eng.done[rid] for rid in ids]
        for rid, r, a in zip(ids, done, answers):
            assert r.out == a[:len(r.out)], f"{method}: {rid} differs from plain"
        steps = sum(r.steps for r in done)
        accepted = sum(sum(r.accepted) for r in done)
        out.append({"seconds": clock.t - t0, "tau": sum(map(len, answers)) / max(steps, 1),
                    "precision": accepted / max(drafted, 1)})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json", help="a bench.py JSON with plain's outputs (not a stripped docs/results one)")
    p.add_argument("--methods", default="suffix,lookahead", help="suffix and/or model-free methods of ours")
    p.add_argument("--config", default="{}", help="JSON: speculative_config keys for our methods")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=73.5, help="a step's fixed cost")
    p.add_argument("--token-ms", type=float, default=3.0, help="per token a step runs")
    p.add_argument("--jump-ms", type=float, default=10.0, help="a step that verifies drafts, once")
    p.add_argument("--knee", type=int, default=0,
                   help="tokens a step runs for --step-ms alone (a flat start, as bf16 at batch 1 on a CPU)")
    p.add_argument("--sequence", action="store_true",
                   help="one proposer per method serves the categories in turn (as bench.py's engines do), so "
                        "what it learns across requests carries from one category to the next; default: a fresh "
                        "proposer per category")
    p.add_argument("--proposer-time", action="store_true",
                   help="add each proposal's own seconds, measured on this host, to its step (a per-row cost "
                        "the cost model lacks; run on an idle host)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="step-time noise: each step's seconds times exp(N(0, NOISE)), e.g. 0.2 (served steps "
                        "vary; a clean clock hides what a bandit does with noisy rewards)")
    p.add_argument("--seed", type=int, default=0, help="--noise's seed")
    args = p.parse_args()
    import bench
    from transformers import AutoTokenizer

    from vllm_spec_plugins.tools.runner import to_token_prompts

    run = json.load(open(args.bench_json))
    outputs = run.get("outputs", {}).get("plain")
    if not outputs:
        raise SystemExit(f"{args.bench_json}: no plain outputs (run bench.py with plain; stripped JSONs have none)")
    argv = run["argv"]
    bargs = bench.parse_args(argv[next(i for i, a in enumerate(argv) if a.endswith("bench.py")) + 1:])
    groups, _ = bench.group_rows(bench.load_rows(bargs), [])
    tok = AutoTokenizer.from_pretrained(run["config"]["model"])
    cost = (args.step_ms / 1000, args.token_ms / 1000, args.jump_ms / 1000, args.knee)
    params = {"vocab_size": len(tok), **json.loads(args.config)}
    print(f"batch {args.batch_size}; step {args.step_ms} ms + {args.token_ms} ms/token past {args.knee} "
          f"+ {args.jump_ms} ms jump")
    cats = list(outputs)
    sets = [(to_token_prompts(tok, groups[c]), [tok.encode(t[0], add_special_tokens=False) for t in outputs[c]])
            for c in cats]

    def run(method):     # per category: its result
        if args.sequence:
            return replay(method, sets, args.batch_size, cost, params, args.proposer_time, args.noise, args.seed)
        return [replay(method, [x], args.batch_size, cost, params, args.proposer_time, args.noise, args.seed)[0]
                for x in sets]

    base = run("plain")
    lines = [f"{c:11s}" for c in cats]
    for m in args.methods.split(","):
        for i, r in enumerate(run(m)):
            lines[i] += f" | {m} {base[i]['seconds'] / r['seconds']:.3f}x plain, tau {r['tau']:.2f}, " \
                        f"precision {r['precision']:.2f}"
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
