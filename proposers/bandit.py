"""`bandit_tree`: a draft tree whose shape (nodes per depth) is chosen online by a bandit.

The drafter is the lookahead pool (prompt lookup, n-grams from the text and from the target's
own Jacobi iterations, and the Jacobi window; `proposers/lookahead.py`): it scores every
candidate node with its estimated probability of acceptance. A shape `widths` keeps, best first,
at most `widths[d]` nodes at depth d+1 (`LookaheadProposer._propose_tree`). The family of shapes
(`shape_family`) runs from no speculation at all, through plain chains, to wide-then-narrow
trees within the node budget.

The bandit is discounted UCB (Garivier & Moulines 2011) over that family, one table per
context = (traffic key, batch-size bucket). Reward of a step = tokens the step produced for a
request (accepted drafts + 1) / the step's measured wall time (drafting + the target's verify
pass + everything else between two proposals), averaged over the requests that used the arm:
tokens per second per request slot, which is what a user pays for. Why UCB, discounted:
* the reward is a ratio of a small count and a noisy time, with no convenient conjugate model
  for Thompson sampling, while UCB only needs a scale (the best arm's mean here);
* the best shape drifts with the text (a code block, then prose) and across requests; a
  discount (effective memory 1/(1-discount) steps) forgets, and the bonus of a forgotten arm
  grows back, so it is re-tried;
* deterministic given the rewards, cheap (a loop over ~10 arms per step), no host sync.
The batch size is part of the context because the cost of a draft token grows with the batch
(at batch 32 the "no speculation" arm usually wins: that is the back-off).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

from .base import RequestStep, StepContext
from .lookahead import LookaheadProposer

logger = logging.getLogger("vllm_spec_plugins")


def shape_family(max_depth: int, max_width: int, node_budget: int, backoff: bool = True) -> list[tuple]:
    """No speculation (if `backoff`), chains of depth 1, 2, 4, ... max_depth, and for each depth
    >= 2 a tree whose first level is max_width wide (narrower if needed to fit `node_budget`),
    halving per level (at least 1). Small on purpose (8 arms for 6/4/16): every arm costs
    exploration."""
    depths = sorted({d for d in (1, 2, 4, 8, 16, 32) if d < max_depth} | {max_depth})
    out: list[tuple] = [()] if backoff else []
    for d in depths:
        for w in (1, max_width) if d > 1 else (1,):
            s = tuple(max(w >> j, 1) for j in range(d))
            while sum(s) > node_budget and w > 1:
                w -= 1
                s = tuple(max(w >> j, 1) for j in range(d))
            if sum(s) <= node_budget and s not in out:
                out.append(s)
    return out


def shape_name(s: tuple) -> str:
    return "-".join(map(str, s)) if s else "none"


class DiscountedUCB:
    """Arms 0..n-1; per arm a discounted count and reward sum. choose(): an untried (or fully
    forgotten) arm first, then argmax mean + c * best_mean * sqrt(2 ln N / n_a)."""

    def __init__(self, n_arms: int, exploration: float, discount: float):
        self.c, self.g = exploration, discount
        self.n = [0.0] * n_arms
        self.s = [0.0] * n_arms
        self.pulls = [0] * n_arms

    def choose(self) -> int:
        for a, n in enumerate(self.n):
            if n < 1e-3:
                return a
        means = [s / n for s, n in zip(self.s, self.n)]
        scale = max(means) or 1.0
        log_n = math.log(sum(self.n))
        ucb = [m + self.c * scale * math.sqrt(2 * max(log_n, 0.0) / n) for m, n in zip(means, self.n)]
        return max(range(len(ucb)), key=ucb.__getitem__)

    def update(self, arm: int, reward: float) -> None:
        g = self.g
        self.n = [n * g for n in self.n]
        self.s = [s * g for s in self.s]
        self.n[arm] += 1.0
        self.s[arm] += reward
        self.pulls[arm] += 1

    def means(self) -> list[float | None]:
        return [s / n if n > 1e-9 else None for s, n in zip(self.s, self.n)]


def batch_bucket(b: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two <= b."""
    return 1 << (max(b, 1).bit_length() - 1)


class BanditTreeProposer(LookaheadProposer):
    """Lookahead drafter + a shape bandit. `scope`: "global" (one table per batch bucket),
    "request" (one per request, freed with it), or "field:NAME" (one per value of the request's
    `SamplingParams.extra_args[NAME]`, e.g. a traffic category; missing -> "global")."""

    def __init__(self, num_speculative_tokens: int, max_depth: int = 6, max_width: int = 4,
                 node_budget: int | None = None, shapes: list | None = None, exploration: float = 0.1,
                 discount: float = 0.995, scope: str = "global", backoff: bool = True,
                 log_every: int = 500, history: int = 20000, clock=time.perf_counter, **lookahead):
        budget = node_budget or num_speculative_tokens
        if not 1 <= budget <= num_speculative_tokens:
            raise ValueError(f"bandit_tree: node_budget must be in [1, num_speculative_tokens="
                             f"{num_speculative_tokens}], got {node_budget}")
        if shapes is None:
            if not 1 <= max_depth <= budget or not 1 <= max_width <= budget:
                raise ValueError(f"bandit_tree: max_depth and max_width must be in [1, node_budget={budget}]")
            shapes = shape_family(max_depth, max_width, budget, backoff)
        shapes = [tuple(int(w) for w in s) for s in shapes]
        if not shapes:
            raise ValueError("bandit_tree: the shape family is empty")
        for s in shapes:
            if any(w < 1 for w in s) or sum(s) > budget:
                raise ValueError(f"bandit_tree: shape {list(s)} needs widths >= 1 and at most "
                                 f"node_budget={budget} nodes")
        if not (0 < discount <= 1) or exploration < 0:
            raise ValueError("bandit_tree: need 0 < discount <= 1 and exploration >= 0")
        if not (scope in ("global", "request") or (scope.startswith("field:") and len(scope) > 6)):
            raise ValueError(f"bandit_tree: scope must be 'global', 'request' or 'field:NAME', got {scope!r}")
        depth = max(len(s) for s in shapes) or 1
        lookahead["window"] = min(lookahead.get("window") or depth, num_speculative_tokens)
        lookahead["ngram"] = min(lookahead.get("ngram") or 4, num_speculative_tokens + 1)
        super().__init__(num_speculative_tokens, tree=True, tree_nodes=budget, **lookahead)
        self.shapes, self.exploration, self.discount, self.scope = shapes, exploration, discount, scope
        self.tables: dict[tuple, DiscountedUCB] = {}
        self.pending: dict[tuple, tuple[int, list[str]]] = {}   # context -> (arm, request ids) of last step
        self.last_start: float | None = None
        self.steps = 0
        self.draft_seconds = 0.0
        self.history: deque = deque(maxlen=history)   # (step, key, bucket, arm, reward)
        self.log_every, self.clock = log_every, clock
        #: set by the engine adapter under tensor parallelism: makes every rank use rank 0's arms
        self.sync = None

    # ---- traffic keys ------------------------------------------------------------------------
    def key_of(self, req: RequestStep) -> str:
        if self.scope == "global":
            return "global"
        if self.scope == "request":
            return req.req_id
        v = (req.tags or {}).get(self.scope[6:])
        return "global" if v is None else str(v)

    def release(self, req_id: str) -> None:
        super().release(req_id)
        if self.scope == "request":
            for ctx in [c for c in self.tables if c[0] == req_id]:
                del self.tables[ctx]
            for ctx in [c for c in self.pending if c[0] == req_id]:
                del self.pending[ctx]

    def table(self, ctx: tuple) -> DiscountedUCB:
        t = self.tables.get(ctx)
        if t is None:
            t = self.tables[ctx] = DiscountedUCB(len(self.shapes), self.exploration, self.discount)
        return t

    # ---- one step ----------------------------------------------------------------------------
    def propose(self, ctx: StepContext) -> list:
        now = self.clock()
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        live = [r for r in ctx.requests if r.sampled]
        if self.last_start is not None and self.pending:
            self._reward(live, now - self.last_start)
        self.pending = {}
        bucket = batch_bucket(len(live))
        keys = sorted({self.key_of(r) for r in live})
        arms = {kk: self.table((kk, bucket)).choose() for kk in keys}
        if self.sync is not None:
            arms = self.sync(arms)
        k = min(self.k, ctx.num_speculative_tokens or self.k)
        out: list = []
        for req in ctx.requests:
            st = self.states.get(req.req_id)
            if st is None:
                st = self.states[req.req_id] = self.new_state(req)
            if not req.sampled:
                out.append([])
                continue
            self.observe(st, req)
            kk = self.key_of(req)
            arm = arms[kk]
            self.pending.setdefault((kk, bucket), (arm, []))[1].append(req.req_id)
            shape = self.shapes[arm]
            out.append(self._propose_tree(st, req, k, list(shape)) if shape and k else [])
        self.steps += 1
        self.last_start = now
        self.draft_seconds += self.clock() - now
        if self.log_every and self.steps % self.log_every == 0:
            logger.info("vllm-spec-plugins bandit_tree: %s", self.describe())
        return out

    def _reward(self, live: list[RequestStep], seconds: float) -> None:
        if seconds <= 0:
            return
        made = {r.req_id: len(r.sampled) for r in live}
        for (kk, bucket), (arm, rids) in self.pending.items():
            got = [made[r] for r in rids if r in made]
            if not got:
                continue
            reward = sum(got) / len(got) / seconds
            self.table((kk, bucket)).update(arm, reward)
            self.history.append((self.steps, kk, bucket, arm, reward))

    # ---- inspection ----------------------------------------------------------------------------
    def describe(self) -> str:
        parts = []
        for (kk, bucket), t in sorted(self.tables.items(), key=lambda x: (str(x[0][0]), x[0][1])):
            means = t.means()
            best = max((a for a in range(len(means)) if means[a] is not None),
                       key=lambda a: means[a], default=None)
            arms = ", ".join(f"{shape_name(self.shapes[a])}:{t.pulls[a]}x"
                             + (f"@{means[a]:.1f}" if means[a] is not None else "")
                             for a in range(len(self.shapes)) if t.pulls[a])
            parts.append(f"[{kk} batch>={bucket}] best {shape_name(self.shapes[best]) if best is not None else '-'}"
                         f" (tok/s per request @ mean reward): {arms}")
        return "; ".join(parts) or "no steps yet"

    def inspect(self) -> dict:
        """Bandit state for metrics, logs and the benchmark's plots."""
        return {"shapes": [list(s) for s in self.shapes], "steps": self.steps,
                "draft_seconds": self.draft_seconds,
                "tables": {f"{kk}|{bucket}": {"pulls": t.pulls, "mean_reward": t.means()}
                           for (kk, bucket), t in self.tables.items()},
                "history": [list(h) for h in self.history]}
