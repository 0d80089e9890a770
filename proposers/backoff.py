"""Back-off for any chain proposer: speculate only where it pays, learned online.

Per batch-size bucket (1, 2, 4, ...), a two-arm discounted UCB (`bandit.DiscountedUCB`): arm 0
drafts nothing, arm 1 lets the wrapped proposer draft. The reward is the one `bandit_tree` uses:
tokens the step produced per request (accepted drafts + 1; always 1 without drafts, so arm 0's
tokens are known every step) over the step's measured wall time (from one proposal to the next:
drafting + the target's pass + everything between). Steps that also ran prefill work are not
rewarded, unless every step does (`STEADY_PREFILL` in a row: continuous traffic, where prefill is
part of every arm's cost; skipping them all would leave the bandit exploring forever). Large
batches, where a draft token costs more than it returns, end up on arm 0; small ones keep
speculating, and the discount re-tries the other arm as the traffic changes.

Drafts only get dearer as the batch grows (the target's pass costs more per verified token while
acceptance does not depend on the batch), so a bucket does not explore its drafts arm while a
smaller bucket measures drafts losing (unless its own measurement says they win): a draft step at
batch 32 costs several plain steps on a CPU, and the smaller buckets re-try for it, cheaper.

The wrapped proposer sees every step: with a budget of 0 when the bucket is on arm 0, so its
per-request state (n-gram pool, Jacobi window, drafter state) stays current.
"""
from __future__ import annotations

import time
from dataclasses import replace

from .bandit import DiscountedUCB, PrefillGate, batch_bucket
from .base import Proposer, StepContext

OFF, ON = 0, 1


class Backoff(Proposer):
    def __init__(self, inner: Proposer, exploration: float = 0.05, discount: float = 0.995,
                 clock=time.perf_counter):
        super().__init__(inner.k)
        self.inner, self.exploration, self.discount, self.clock = inner, exploration, discount, clock
        self.needs_target_argmax = inner.needs_target_argmax
        self.needs_hidden_states = inner.needs_hidden_states
        self.states = inner.states
        self.tables: dict[int, DiscountedUCB] = {}
        self.pending: tuple[int, int, list[str]] | None = None   # (bucket, arm, request ids)
        self.last_start: float | None = None
        self.history: list[tuple[int, int]] = []                 # (bucket, arm) per step, bounded
        self.backoff_stats = {"steps_on": 0, "steps_off": 0}
        self.seen: set[str] = set()        # requests past their first step (freed with them)
        self.sync = None                   # tensor parallel: rank 0's arm for every rank
        self.gate = PrefillGate()

    # the wrapped proposer's extras (plugin_state_summary / bench read these)
    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self.seen.discard(req_id)

    def table(self, bucket: int) -> DiscountedUCB:
        t = self.tables.get(bucket)
        if t is None:
            t = self.tables[bucket] = DiscountedUCB(2, self.exploration, self.discount)
        return t

    def choose(self, bucket: int) -> int:
        t = self.table(bucket)
        arm = t.choose()
        if arm == ON and _on_wins(t) is not True and any(b < bucket and _on_wins(s) is False
                                                          for b, s in self.tables.items()):
            arm = OFF
        return arm

    def propose(self, ctx: StepContext) -> list:
        now = self.clock()
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.seen.discard(rid)
        live = [r for r in ctx.requests if r.sampled]
        # a step that prefilled anything (a chunk, or a request's first token) is not rewarded
        prefill = len(live) < len(ctx.requests) or any(r.req_id not in self.seen for r in live)
        self.seen.update(r.req_id for r in live)
        if self.gate.rewards(prefill) and self.pending is not None and self.last_start is not None:
            bucket, arm, rids = self.pending
            by_id = {r.req_id: r for r in live}
            done = [by_id[r] for r in rids if r in by_id]
            if done:
                tokens = sum(len(r.sampled) for r in done) / len(done)
                self.table(bucket).step(arm, now - self.last_start, {arm: tokens, OFF: 1.0})
        self.pending = None
        budget = ctx.budget(self.k)
        if live and budget:
            bucket = batch_bucket(len(live))
            arm = self.choose(bucket)
            if self.sync is not None:
                arm = self.sync(arm)
            self.pending = (bucket, arm, [r.req_id for r in live])
            self.backoff_stats["steps_on" if arm == ON else "steps_off"] += 1
            self.history.append((bucket, arm))
            del self.history[:-4096]
            if arm == OFF:
                budget = 0
        out = self.inner.propose(replace(ctx, num_speculative_tokens=budget))
        self.last_start = now
        return out

    def backoff_state(self) -> dict:
        """Per bucket: the learned rates (tokens / s / request) of [off, on] and pull counts."""
        return {str(b): {"rate_off_on": t.means(), "pulls_off_on": list(t.pulls)}
                for b, t in sorted(self.tables.items())}


def _on_wins(t: DiscountedUCB) -> bool | None:
    """Whether drafting measures at least as fast as not drafting; None until both are measured."""
    r = t.means()
    return None if None in r else r[ON] >= r[OFF]
