"""Goodput: per step, draft only the tokens that pay for their verification, over the whole batch.

A draft token pays when its chance of being accepted is worth more than the time its
verification adds. Both are measured, apart:

* cost (`StepCost`): a step's seconds, from the end of one proposal to the start of the next
  (the engine's scheduling, the target's pass, sampling), fitted online as a + b * Q + p * P +
  a jump for any step that verifies drafts + e * the context read, Q the decoding rows' query
  tokens (1 + drafts each), P the prefill tokens, with a lower slope up to `KNEE` query tokens.
  b + e * context is the price of one more verified token: ~0.8-1.2 ms on a ~24 ms batch-8 step
  here (2 CPU cores, bf16), near 0 for the first few drafts at batch 1 and on a GPU's flat part.
* acceptance (`AcceptModel`): each draft token carries a class from its proposer (where it came
  from, its depth, the drafter's confidence). The chance that a token is accepted once its
  parent was is learned per class from the verified drafts: over all requests (decayed counts
  over the proposer's prior) and per request (shrunk towards the global rate: a code request
  and a chat request differ). Acceptance does not depend on the batch size and cost does, so
  what was learned at batch 1 holds at batch 32 at once; a bandit per batch size re-learns both.

Each step the wrapped proposer drafts its full chains; a token's p is the product of its own
and its ancestors' rates (its chance of acceptance), scaled by the accepted / expected tokens
of the drafts kept so far where that is under 1 (`calibration`). Over the whole batch, best p
first, a token is kept while p > b * R, R = tokens the step makes / its predicted seconds with
what is kept so far: the marginal token must make more than it costs at the step's own rate. On
this CPU that is p > ~0 for the first drafts at batch 1 (up to the knee), ~4% past them, and
~40% at batch 8 (bf16); on a GPU it keeps everything until the cost curve bends. p falls along a
chain, so what is kept is a prefix of each chain.

A proposer that costs next to nothing (a pool, a lookup: under 2% of a step) runs every step and
the cut decides; it is asked for no deeper a chain than the cut could keep with this step's rates
and prices, and for none where no draft can pay (`_reachable`: a verified token as dear as a row's
step), so such a step costs about what a plain one does. One that costs real time (a draft model)
runs only while it pays (so does a lookup whose seconds per row pass `cheap` of a step, as at
batch 8 here, but it is asked for a cheap proposer's depth: its seconds do not grow with depth,
`depth_free`): per batch-size bucket its own seconds per row, the accepted tokens the cut
expected per request (scaled by the ratio of accepted to expected tokens measured so far) and the
drafts kept are tracked, and the predicted rate with drafts (R_on, with its own time and the jump)
is compared with the rate without (R_off). It is switched off by measurements, not by a prior, and
learning costs a cold batch a few rows, not all: the first step drafts for the one row whose chain
it keeps (no step measured yet), a step that verifies no drafts drafts none, and until its steady
seconds per row and its gain are measured the proposer drafts as a probe does (`probe_rows` rows,
two steps). R_on is taken with the gain one standard error above its mean over the drafting steps
measured (optimism that fades as they add up), so a drafter that pays is never switched off by the
few noisy steps of a cold server, and one that loses where verification is dear is off after a
handful. R_off is priced from plain steps: on a cold fit one step in ~4 verifies no drafts until
two are measured (`StepCost.needs_plain`), and the expected gain's calibration is shrunk towards 1
(a cold request's first rejections are luck, not a rate). Its own seconds are priced from steady
steps only: not its first call (cold: allocations, first kernel runs), not a step where a row
catches up on tokens it skipped while off (a one-off of drafting again, priced with the probe).
While off, `probe_rows` requests (in turn) draft again once the probe's cost (with its catch-ups,
and its scans of prompts the proposer had not seen: a drafter that stays off never makes them) has
fallen to ~1% of the time since the last one, two steps in a row: the first pays the catch-up, the
second measures the steady cost. The wrapped proposer sees every step (with a budget of 0 while
off) and catches up on what it skipped when it drafts again. A proposer with a cheap part of its
own (`propose_fallback`: a cascade's model-free level, n-gram lookup beside a Mamba drafter) has
that part draft alone while off, cut as a cheap proposer's drafts are; R_off is then the rate of
those steps (their gain, kept drafts and jumps, measured as R_on's are). While the drafter pays,
its cheap part still drafts alone one step in `FALLBACK_EVERY` (one in `FALLBACK_WARM` until
`FALLBACK_MIN` such steps are measured): otherwise R_off is priced as plain decoding, and a drafter
that beats plain but not its own cheap part would never give way to it.

Every `explore_every`-th step that drafts anyway, one request (in turn) gets one token past its
cut, so classes below the current threshold keep being measured.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import numpy as np

from vllm_spec_plugins.scorers.tree import DraftTree

from .base import Proposer, StepContext
from .cost import Price, StepCost, batch_bucket, continues, mean_context, step_features

#: depth index of the generic classes (a proposer without classes of its own): min(depth, DEPTHS) - 1
DEPTHS = 4

#: every SHADOW_EVERY-th step where no draft can pay, a lookup (`depth_free`) still drafts one
#: token for each greedy row, cut unverified (`observe_chain`): the rates it is priced by keep
#: following the text, and drafting resumes when the text starts to repeat. `bandit_tree` shadows
#: its chain arm as often while "no speculation" is pulled.
SHADOW_EVERY = 4

#: while a drafter with a cheap part pays, one step in FALLBACK_EVERY has the cheap part draft
#: alone, one in FALLBACK_WARM until FALLBACK_MIN such steps are measured: R_off is measured, not
#: assumed to be plain decoding's rate
FALLBACK_EVERY, FALLBACK_WARM, FALLBACK_MIN = 16, 4, 4


class AcceptModel:
    """P(token accepted | its parent accepted) per token class: global decayed counts over a
    prior, and per request, counts shrunk towards the global rate."""

    def __init__(self, prior: np.ndarray, prior_weight: float = 4.0, decay: float = 0.999,
                 request_weight: float = 8.0, request_decay: float = 0.97):
        self.prior = np.asarray(prior, dtype=np.float64)
        self.pw, self.decay, self.rw, self.rdecay = prior_weight, decay, request_weight, request_decay
        self.tries = np.zeros_like(self.prior)
        self.hits = np.zeros_like(self.prior)
        self.req: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def global_rate(self) -> np.ndarray:
        return (self.hits + self.pw * self.prior) / (self.tries + self.pw)

    def optimistic_rate(self) -> np.ndarray:
        """Global rate + one posterior standard deviation: a class measured little is tried where
        it could plausibly pay; the bonus vanishes as it is measured."""
        g = self.global_rate()
        return np.minimum(g + np.sqrt(g * (1 - g) / (self.tries + self.pw + 1)), 1.0)

    def rates(self, rid: str, glob: np.ndarray | None = None) -> np.ndarray:
        """Per class for request `rid`: its own counts shrunk towards `glob` (default: the
        optimistic global rate)."""
        g = self.optimistic_rate() if glob is None else glob
        r = self.req.get(rid)
        if r is None:
            return g
        return (r[1] + self.rw * g) / (r[0] + self.rw)

    def observe(self, rid: str, classes: list[int], accepted: int) -> None:
        """A verified chain: tokens 0..accepted were reached, 0..accepted-1 accepted."""
        reached = classes[:accepted + 1]
        if not len(reached):
            return
        hit = reached[:accepted]
        r = self.req.get(rid)
        if r is None:
            r = self.req[rid] = (np.zeros_like(self.prior), np.zeros_like(self.prior))
        self.tries *= self.decay
        self.hits *= self.decay
        r[0][:] *= self.rdecay
        r[1][:] *= self.rdecay
        for c in reached:        # a few tokens a step: a loop costs less than np.add.at's set-up
            self.tries[c] += 1.0
            r[0][c] += 1.0
        for c in hit:
            self.hits[c] += 1.0
            r[1][c] += 1.0

    def release(self, rid: str) -> None:
        self.req.pop(rid, None)


def _cuttable(req, drafts) -> bool:
    """Whether goodput cuts this row's drafts: a non-empty chain (a `DraftTree` passes through
    uncut) of a request our acceptance serves exactly (`tree_ok`; others draft nothing)."""
    return bool(len(drafts)) and req.tree_ok and not isinstance(drafts, DraftTree)


def chances(rate: list[float], classes) -> list[float]:
    """Each token's chance of acceptance along a chain: the product of its own and its
    ancestors' class rates."""
    out, p = [], 1.0
    for c in classes:
        p *= rate[c]
        out.append(p)
    return out


def observe_chain(accept: AcceptModel, r, classes: list[int], chain: list[int] | None) -> None:
    """What row `r` tells `accept` about the chain drafted for it last step (`classes` one per
    token). Without its tokens (`chain` None): the drafts the step verified, as far as accepted.
    With them (a greedy row), verified or not: the tokens the step made are the target's argmax
    continuation, so the chain would have been accepted as far as it matches them. Past its
    verified drafts that is one token more per row and step measured for free (the first token
    past a cut, where every kept one was accepted), and a chain drafted but not handed out at all
    is measured as one that was."""
    if chain is None:
        if classes and r.drafts and r.tree_parents is None:
            accept.observe(r.req_id, classes[:len(r.drafts)], min(r.num_accepted, len(r.drafts)))
        return
    made, j = r.sampled, 0
    while j < len(chain) and j < len(made) and chain[j] == made[j]:
        j += 1
    if j < len(chain) and j < len(made):       # rejected at j
        accept.observe(r.req_id, classes[:j + 1], j)
    else:                                      # accepted as far as the step's tokens tell
        accept.observe(r.req_id, classes[:j], j)


def price_cut(items: list, keep, n: int, price: Price, extra: int = 0) -> tuple[float, int]:
    """Goodput's cut: over `items` (-p, depth, row), best p first, a token is kept
    (`keep[row] += 1`) while p > b * R, b its price (`Price.token`: the marginal seconds of one more
    query token), R = tokens the step makes (n rows + the kept tokens' chances) over its predicted
    seconds with the n + extra query tokens so far and the jump, `extra` the verified tokens so
    far (`extra` to start with: priced already). p falls along a chain (rates <= 1), so what is
    kept is a prefix of every chain; b * R only rises as tokens are kept (where the price past the
    knee is not below the price before it: the cut then stops at its first loser). Returns
    (tokens the step is expected to make, `extra` at the end)."""
    items.sort()
    made = float(n)
    for neg_p, _, i in items:
        p = -neg_p
        q = n + extra
        if p * (price.seconds(q) + price.jump) <= price.token(q) * made:   # p <= b * R: this and all after lose
            break
        keep[i] += 1
        made += p
        extra += 1
    return made, extra


def drafting_pays(price: Price, n: int, made: float, extra: int) -> bool:
    """Whether a step of n rows that verifies `extra` drafts, expected to make `made` tokens, beats
    a plain step's rate once its drafts and jump are paid: (made - n) * plain seconds > n * the
    seconds the drafts add."""
    return (made - n) * price.seconds(n) > n * (price.more(n, extra) + price.jump)


def generic_classes(n: int) -> list[int]:
    """Classes by depth alone, for proposers that give none."""
    return [min(j, DEPTHS - 1) for j in range(n)]


class Goodput(Proposer):
    """Wraps a chain proposer; chains are cut per token (a tree would pass through uncut). The
    proposer may set `classes` (one list per row, aligned with its drafts) during `propose`, and
    `class_prior` (rate per class before any evidence)."""

    def __init__(self, inner: Proposer, explore_every: int = 4, probe_every: int = 16, probe_rows: int = 4,
                 cheap: float = 0.02, probe_share: float = 0.01, clock=time.perf_counter):
        super().__init__(inner.k)
        self.inner, self.explore_every, self.probe_every, self.clock = inner, explore_every, probe_every, clock
        self.probe_rows, self.cheap, self.probe_share = probe_rows, cheap, probe_share
        # discounted (accepted, expected) tokens of drafting steps, the cheap part's alone included:
        # R_off is priced from the cheap part's own steps, which run only while the drafter is off,
        # and against an optimistic R_on that leans to the drafter; pooled, the cheap part's record
        # moves the drafter's calibration too. Kept apart, the drafter stayed on where the cheap part
        # alone makes more, and `mamba` ran slower beside plain at batch 1 on every category.
        self._cal = [0.0, 0.0]
        self.needs_target_argmax = inner.needs_target_argmax
        self.needs_hidden_states = inner.needs_hidden_states
        self.states = inner.states
        prior = inner.class_prior
        self.accept = AcceptModel(prior if prior is not None else np.full(DEPTHS, 0.3))
        self.cost = StepCost()
        #: req id -> (classes, tokens) of the chain handed out last step: tokens None, or, for a
        #: greedy row, the drafts handed out and the first one cut (`observe_chain`)
        self.sent: dict[str, tuple[list[int], list[int] | None]] = {}
        self.last_end: float | None = None
        self._ids: set = set()                   # request ids of the last step (`continues`)
        self.buckets: dict[int, dict] = {}       # batch bucket -> drafter accounting (EMAs)
        self.steps = 0
        self.context = 0.0                       # mean context length of last step's decoding rows
        self.sync = None                         # tensor parallel: rank 0's decisions for every rank
        # expected: accepted tokens the kept drafts were predicted to make; accepted: what the
        # target accepted of them (calibration of the acceptance model), in rows that reported back
        self.goodput_stats = {"steps": 0, "drafting_steps": 0, "probes": 0, "fallback_steps": 0, "drafted": 0,
                              "kept": 0, "explored": 0, "expected": 0.0, "accepted": 0}
        #: per step with live requests: (step, batch size, drafted, kept, price b * R of the last
        #: kept token's threshold); bounded
        self.history: deque = deque(maxlen=20000)
        self._threshold, self._last_gain, self._forced, self._blind = 0.0, 0.0, False, False
        self._reach: list[float] = []            # last cut's mean chance of acceptance per depth
        self._row_rates: dict[str, list[float]] = {}   # req id -> its rates per class this step
        #: req id -> the chances of the tokens the last drafting step's cut kept in its row (their
        #: sum: what it expected of them); None: no such step
        self._pending: dict[str, list[float]] | None = None
        self._row_gain: dict[str, list[float]] = {}    # the same, from the last cut
        #: per tenth of a kept token's chance: (tokens, their chances summed, accepted), in rows
        #: that reported back: how well the acceptance model is calibrated on this traffic
        self.reliability = [[0, 0.0, 0] for _ in range(10)]
        self._live: set = set()                  # request ids that decoded last step
        self._drafting: set = set()              # those the wrapped proposer drafted for
        self._probe: set | None = None           # request ids of a probe's first step (its second follows)
        self._probe_s = 0.0                      # seconds of the probe under way (both steps, jump included)
        self._warm = False                       # the wrapped proposer has drafted once (its cold call)
        self._cold_row_s: float | None = None    # seconds per row of that call, its prompt scans included

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self.accept.release(req_id)
        self.sent.pop(req_id, None)

    # ---- drafting on/off ------------------------------------------------------------------
    def _bucket(self, b: int) -> dict:
        """Accounting per batch-size bucket: EMAs of the proposer's seconds per row per steady step
        with and without a budget, and, per drafting step, of the accepted tokens the cut expected
        per request (`n`: steps measured), the drafts it kept per request and
        whether it kept any; the seconds of the last probe. A new bucket starts from the nearest
        measured one (acceptance does not depend on the batch; seconds are per row)."""
        s = self.buckets.get(b)
        if s is None:
            s = {"on_row_s": None, "off_row_s": None, "gain": None, "n": 0, "kept": None,
                 "frac": None, "off_steps": 0, "depth": None, "probe_s": None, "reach": [None] * self.k,
                 "fb_gain": None, "fb_kept": None, "fb_frac": None, "fb_n": 0, "since_fb": 0}
            near = self._nearest(b, "gain")
            if near is not None:
                s |= {k: self.buckets[near][k] for k in ("on_row_s", "off_row_s", "gain", "n", "kept",
                                                         "frac", "depth")}
                s["reach"] = list(self.buckets[near]["reach"])
            self.buckets[b] = s
        return s

    def _nearest(self, b: int, field: str) -> int | None:
        """The bucket nearest to batch size b (in powers of two) whose `field` is measured, or None."""
        return min((k for k, v in self.buckets.items() if v[field] is not None),
                   key=lambda k: abs(k.bit_length() - b.bit_length()), default=None)

    #: pseudo-tokens that shrink `calibration` towards 1: the first few drafting steps' luck (a
    #: cold chat request's first tokens all rejected) must not scale every later expectation
    CAL_PRIOR = 4.0

    def calibration(self) -> float:
        """Accepted tokens the target reported / tokens the cut expected, over recent drafting
        steps, shrunk towards 1 by `CAL_PRIOR` tokens."""
        c = self.CAL_PRIOR
        return min(max((self._cal[0] + c) / (self._cal[1] + c), 0.2), 2.0)

    def _costly(self, bucket: dict, n: int, fit, optimistic: bool = False) -> tuple[float, float] | None:
        """For a proposer whose own seconds are over `cheap` of a step at batch n: (a plain step's
        seconds, R_on = tokens per second of a drafting step, with the gain the cut expects
        scaled by `calibration`, the proposer's time and the verification); None below that.
        `optimistic`: the gain one standard error above its mean (`gain_bound`)."""
        step = fit.seconds(n)
        if n * max(bucket["on_row_s"] - (bucket["off_row_s"] or 0.0), 0.0) <= self.cheap * step:
            return None
        gain = bucket["gain"] * self.calibration()
        if optimistic:
            gain = self.gain_bound(gain, bucket["n"])
        return step, n * (1 + gain) / (step + fit.more(n, n * bucket["kept"]) + fit.jump * bucket["frac"]
                                       + n * bucket["on_row_s"])

    @staticmethod
    def gain_bound(gain: float, n: int) -> float:
        """`gain` (accepted tokens per request and drafting step) plus one standard error of its
        mean over the `n` steps measured, a step's accepted tokens counted as geometric (variance
        gain * (1 + gain)): large while few steps are measured, it vanishes as they add up."""
        return gain + (max(gain, 0.0) * (1 + max(gain, 0.0)) / max(n, 1)) ** 0.5

    def _mode(self, bucket: dict, n: int) -> str:
        """"on", "off", "probe" (a few rows draft), "blind" (no step measured yet: the one row
        whose chain `_allocate` keeps drafts) or "plain" (a step that verifies no drafts,
        `StepCost.needs_plain`: none are drafted). Until its steady cost and gain are measured, a
        proposer drafts as a probe. Then one that costs next to nothing (under `cheap` of a step)
        always runs: the cut already drafts nothing when nothing pays. One that costs real time
        (a draft model) runs while R_on >= R_off, with the gain the cut expects (scaled by
        `calibration`) one standard error above its mean (`gain_bound`); while off it probes when
        the probe's cost (`probe_s`: its two steps, catch-up, scans of prompts it had not seen and
        jumps included) has fallen to
        `probe_share` of the time since the last (never sooner than `probe_every` steps)."""
        if self._probe is not None:            # a probe's second step: the steady one
            return "probe"
        if self.cost.n == 0:
            return "blind"
        if self.cost.needs_plain():
            return "plain"
        if bucket["on_row_s"] is None or bucket["gain"] is None:
            return "probe"
        fit = self.cost.fit(n, self.context) or Price(0.0, 0.0, 0.0)
        costly = self._costly(bucket, n, fit, optimistic=True)
        if costly is None:
            return "on"
        step, on = costly
        jump = fit.jump
        gain, verify = 0.0, 0.0
        if bucket["fb_gain"] is not None:    # off, the cheap part drafts alone (`propose_fallback`)
            gain = bucket["fb_gain"] * self.calibration()
            verify = fit.more(n, n * bucket["fb_kept"]) + jump * bucket["fb_frac"]
        off = n * (1 + gain) / (step + n * (bucket["off_row_s"] or 0.0) + verify)
        if on >= off:
            if self.inner.propose_fallback is not None and bucket["since_fb"] >= (
                    FALLBACK_WARM if bucket["fb_n"] < FALLBACK_MIN else FALLBACK_EVERY):
                return "off"                 # the cheap part alone, measured now and then
            return "on"
        probe = bucket["probe_s"] or self._probe_estimate(n, bucket["on_row_s"], jump)
        gap = min(max(probe / (self.probe_share * step) if step > 0 else 0.0, self.probe_every), 16 * self.probe_every)
        return "probe" if bucket["off_steps"] >= gap else "off"

    def _probe_estimate(self, n: int, on_row_s: float, jump: float) -> float:
        """A probe's seconds at batch n before one was measured there. A probe drafts for
        min(probe_rows, n) rows whatever the batch, so one measured at another batch size holds,
        per row. Else its first step is priced as the cold call's rows were (they too scanned
        what the drafter had not seen) and its second as a steady step, with a jump each. Priced
        as two steady steps, a first probe would come 8-18x too soon (the Mamba drafter at batch
        8 here: probes of 40-90 ms against ~5 ms)."""
        rows = min(self.probe_rows, n)
        k = self._nearest(n, "probe_s")
        if k is not None:
            return self.buckets[k]["probe_s"] * rows / min(self.probe_rows, k)
        return rows * (max(self._cold_row_s or 0.0, on_row_s) + on_row_s) + 2 * jump

    def _depth(self, bucket: dict, n: int, budget: int) -> int:
        """Chain length to ask a costly proposer for (a draft model pays for every token it
        drafts, kept or cut): depth j is drafted while the mean chance that a row's j-th token
        is accepted (`reach`, measured where drafted) pays for one more drafter step and its
        verification at the step's rate, p_j > (b + drafter seconds per token) * R. One depth
        more every `explore_every`-th drafting step keeps the next depth measured. A proposer
        that costs next to nothing, or whose seconds do not grow with depth (`depth_free`),
        drafts `budget` (the cut decides; `_reachable` bounds both): a mean over rows would cut
        the one row whose long match pays at every depth to what the average row's chain pays
        (lookahead at batch 8 here: ~2-4 tokens asked of 16, where a lookup costs ~2.5% of a step)."""
        if self.inner.depth_free:
            return budget
        fit = self.cost.fit(n, self.context)
        if fit is None or bucket["on_row_s"] is None or bucket["gain"] is None or not bucket["depth"]:
            return budget
        costly = self._costly(bucket, n, fit)
        if costly is None:
            return budget
        # a verified token priced where the rows' kept tokens usually end
        price = (fit.token(n * (1 + bucket["kept"])) + bucket["on_row_s"] / bucket["depth"]) * costly[1]
        d = 1
        while d < budget and bucket["reach"][d] is not None and bucket["reach"][d] > price:
            d += 1
        if d < budget and (bucket["reach"][d] is None or self.steps % self.explore_every == 0):
            d += 1
        return d

    def _reachable(self, fit, n: int, budget: int) -> int:
        """Chain length past which `_allocate` keeps nothing, whatever the tokens (0: nothing at
        all), from this step's rates: a token at depth j of a row has p <= top ** (j + 1), top
        that row's best rate of any class. The cut's price b * R only rises as tokens are kept,
        so it is at least b * n / (a + b * n + jump), b the cheapest draft's price
        (`Price.cheapest`; a plain step's seconds a + b * n): no token below it is kept. And drafting at
        all pays only if the kept tokens' p * (a + b * n) - b * n add up past n * jump: where a
        verified token costs what a row's step does (kernels capped at AVX2, batch 8, here) no
        token can, and the proposer is not asked to draft: a step that drafts nothing costs next
        to what a plain one does. Where verification is cheap: the whole budget. One token more
        than the deepest that could be kept, for the explore token past a cut. Decisions equal
        the full chains'."""
        if fit is None or not self._row_rates:
            return budget
        b, plain, jump = fit.cheapest(n), fit.seconds(n), fit.jump
        step = plain + jump
        if b <= 0 or plain <= 0:
            return budget
        price, deepest, net = b * n / step, 0, 0.0
        for rates in self._row_rates.values():
            top = max(rates)
            d, p = 0, top
            while d < budget and p > price:
                net += max(p * plain - b * n, 0.0)
                d, p = d + 1, p * top
            deepest = max(deepest, d)
        if net <= n * jump or not deepest:
            return 0
        return min(deepest + 1, budget)

    @staticmethod
    def _ema(old, new, w=0.1, n: int | None = None):
        """Exponential average; with `n` (samples so far, this one included) the plain mean while
        n < 1 / w: the first samples all count, not the first alone."""
        if n is not None:
            w = max(w, 1.0 / max(n, 1))
        return new if old is None else (1 - w) * old + w * new

    # ---- one step ----------------------------------------------------------------------------
    def propose(self, ctx: StepContext) -> list:
        now = self.clock()
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.accept.release(rid)
            self.sent.pop(rid, None)
        live = [i for i, r in enumerate(ctx.requests) if r.sampled]
        self._ids, timed = continues(self._ids, ctx.requests)
        if self.last_end is not None and timed:
            self.cost.observe(seconds=now - self.last_end, **step_features(ctx))
        for i in live:
            r = ctx.requests[i]
            sent = self.sent.pop(r.req_id, None)
            if sent is not None:                # a chain we cut: its classes learn
                observe_chain(self.accept, r, *sent)
        if self._pending is not None:        # what last step's cut expected, against what it made
            # of the tokens it kept (not the explore token), in the rows that report back: a
            # request that finished in the step (its last tokens, often accepted drafts) never
            # does, and counted as expected it read as optimism
            expected, realized = 0.0, 0
            for i in live:
                r = ctx.requests[i]
                if r.req_id in self._pending and r.drafts:
                    ps = self._pending[r.req_id][:len(r.drafts)]    # as far as the engine verified
                    expected += sum(ps)
                    realized += min(r.num_accepted, len(ps))
                    for j, p in enumerate(ps):
                        b = self.reliability[min(int(p * 10), 9)]
                        b[0] += 1
                        b[1] += p
                        b[2] += j < r.num_accepted
            self.goodput_stats["expected"] += expected
            self.goodput_stats["accepted"] += realized
            self._cal = [0.99 * self._cal[0] + realized, 0.99 * self._cal[1] + expected]
            self._pending = None
        budget, n = ctx.budget(self.k), len(live)
        if n:
            self.context = mean_context([ctx.requests[i] for i in live])
        bucket = self._bucket(batch_bucket(n)) if n else None
        if self._probe is not None:          # the probe's second step: its rows, if still here
            second = [i for i in live if ctx.requests[i].req_id in self._probe]
            if not second:
                self._probe = None
        mode = self._mode(bucket, n) if budget and n else "off"
        if self.sync is not None:
            mode = self.sync(mode)
        rows = list(range(len(ctx.requests)))
        if mode == "probe":                  # a few rows, in turn: a probe must stay cheap
            if self._probe is not None:
                rows = second
            else:
                start = (self.steps * self.probe_rows) % n
                rows = sorted(set((live * 2)[start:start + self.probe_rows]))
        elif mode == "blind":                # one row's chain is all `_allocate` keeps: one row drafts
            rows = [next((i for i in live if ctx.requests[i].tree_ok), live[0])]
        sub = ctx if len(rows) == len(ctx.requests) else replace(ctx, requests=[ctx.requests[i] for i in rows])
        # off: the proposer's cheap part alone drafts, where it has one (`propose_fallback`)
        fallback = mode == "off" and bool(budget and n) and self.inner.propose_fallback is not None
        drafts = mode not in ("off", "plain") or fallback    # "plain": nothing verified, nothing drafted
        self._row_rates = {}
        if not drafts:
            depth = 0
        else:       # no deeper than the cut could keep: nothing where nothing can pay (a probe too)
            # each drafting row's rates this step (`rates`: its counts shrunk towards the global rate)
            glob = self.accept.global_rate()
            self._row_rates = {ctx.requests[i].req_id: self.accept.rates(ctx.requests[i].req_id, glob).tolist()
                               for i in rows if ctx.requests[i].sampled}
            depth = self._reachable(self.cost.fit(n, self.context), n, budget if fallback else
                                    self._depth(bucket, n, budget))
            if (not depth and self.inner.depth_free and self.steps % SHADOW_EVERY == 0
                    and any(ctx.requests[i].greedy for i in rows)):
                depth = 1             # for `observe_chain` alone: `_allocate` keeps none of it
        if self.sync is not None:
            depth = self.sync(depth)
        ran = {r.req_id for r in sub.requests if r.sampled} if depth and not fallback else set()
        # a row that decoded last step without drafting catches up on what it skipped: a one-off
        resumed = any(rid in self._live and rid not in self._drafting for rid in ran)
        self._live, self._drafting = {ctx.requests[i].req_id for i in live}, ran
        once0 = self.inner.once_seconds
        t0 = self.clock()
        drafted = (self.inner.propose_fallback if fallback else self.inner.propose)(
            replace(sub, num_speculative_tokens=depth))
        # a request's one-off work (a draft model's scan of its prompt) is not a step's cost; a
        # probe's is the probe's: a drafter that stays off never scans the rows it probed
        once = self.inner.once_seconds - once0
        draft_s = self.clock() - t0 - once
        cls = self.inner.classes or [generic_classes(len(d)) for d in drafted]
        kept = self._allocate(sub, drafted, cls, n) if drafts else [0] * len(drafted)
        if self.sync is not None:
            kept = self.sync(kept)
        out: list = [[] for _ in ctx.requests]
        for i, d, c, m in zip(rows, drafted, cls, kept):
            if isinstance(d, DraftTree):           # a DraftTree: not ours to cut
                out[i] = d
                continue
            out[i] = list(d[:m])
            req = ctx.requests[i]
            if req.greedy and _cuttable(req, d):    # and the first token cut: `observe_chain`
                self.sent[req.req_id] = (list(c[:m + 1]), [int(x) for x in d[:m + 1]])
            elif m:
                self.sent[req.req_id] = (list(c[:m]), None)
        if n:
            self.history.append((self.steps, n, sum(len(d) for d in drafted) if drafts else 0,
                                 sum(kept), self._threshold if drafts else None))
        self.steps += 1
        st = self.goodput_stats
        st["steps"] += 1
        if mode == "probe":                  # a probe's seconds: both its steps, their jumps and scans
            fit = self.cost.fit(n, self.context)
            self._probe_s = (self._probe_s if self._probe is not None else 0.0) + draft_s + once \
                + (fit.jump if fit else 0.0)
            if self._probe is not None:
                bucket["probe_s"] = self._probe_s
            self._probe = None if self._probe is not None else {r.req_id for r in sub.requests if r.sampled}
        if bucket is not None and budget:
            if mode == "off":
                bucket["off_row_s"] = self._ema(bucket["off_row_s"], draft_s / n)
                bucket["off_steps"] += 1
                if fallback and not self._forced:    # what the cheap part alone makes: R_off's gain
                    st["fallback_steps"] += 1
                    st["drafted"] += sum(len(d) for d in drafted)
                    st["kept"] += sum(kept)
                    bucket["fb_n"] += 1
                    bucket["since_fb"] = 0
                    for f, v in (("fb_gain", self._last_gain / n), ("fb_kept", sum(kept) / n),
                                 ("fb_frac", float(any(kept)))):
                        bucket[f] = self._ema(bucket[f], v, 0.05, bucket["fb_n"])
                    self._pending = self._row_gain
            elif drafts and not self._forced:
                m = sum(1 for r in sub.requests if r.sampled)
                st["drafting_steps"] += 1
                st["probes"] += mode == "probe"
                st["drafted"] += sum(len(d) for d in drafted)
                st["kept"] += sum(kept)
                # slow averages: one step's gain is noisy (a confident stretch, then none), and
                # on/off must follow the mean, not the last few steps; a probe counts double
                w = 0.1 if mode == "probe" else 0.05
                if self._warm and not resumed and m and ran:     # steady seconds only (see the module doc)
                    row_s = draft_s / m if bucket["on_row_s"] is None else min(draft_s / m, 4 * bucket["on_row_s"])
                    bucket["on_row_s"] = self._ema(bucket["on_row_s"], row_s, w)   # (one stall: bounded)
                if not self._warm and ran and m:          # the cold call: a first probe is priced like it
                    self._cold_row_s = (draft_s + once) / m
                self._warm = self._warm or bool(ran)
                if ran:                                   # (`_reachable` may ask for nothing)
                    bucket["depth"] = self._ema(bucket["depth"], max((len(d) for d in drafted), default=0), w)
                bucket["off_steps"] = 0
                bucket["since_fb"] += mode == "on"
                if not self._blind and m:                # the blind first step: no gain to learn
                    bucket["n"] += 1
                    g = self._last_gain / m
                    bucket["gain"] = self._ema(bucket["gain"], g, w, bucket["n"])
                    bucket["kept"] = self._ema(bucket["kept"], sum(kept) / m, w, bucket["n"])
                    bucket["frac"] = self._ema(bucket["frac"], float(any(kept)), w, bucket["n"])
                    reach = bucket["reach"]
                    for j, p in enumerate(self._reach):      # `_ema`, inline: up to k depths a step
                        reach[j] = p if reach[j] is None else (1 - w) * reach[j] + w * p
                    self._pending = self._row_gain
        self.last_end = self.clock()
        return out

    def _allocate(self, ctx: StepContext, drafts: list, classes: list, n: int) -> list[int]:
        """Tokens kept per row of `ctx` (all of a batch of `n` live requests, or a probe's few):
        best p first, while p > b * R of the whole batch's step; nothing at all when the kept
        tokens do not cover the step's jump. Sets `_last_gain` (accepted tokens the kept drafts
        are expected to make), `_threshold` (b * R at the cut) and `_blind` (no step measured
        yet: one row's chain kept whole)."""
        self._last_gain, self._threshold, self._forced, self._reach = 0.0, 0.0, False, []
        self._row_gain = {}
        self._blind = self.cost.n == 0
        keep = [0] * len(drafts)
        if self._blind:
            # A cold server's first decode step: one row's whole chain measures every depth's
            # class at once (classes are shared by all rows) and what a draft costs; the next
            # step verifies none (`needs_plain`). Every row's whole chain would cost a cold batch
            # of 8 a step of ~5x a plain one here (128 drafts) for the same measurement.
            i = next((i for i, (req, d) in enumerate(zip(ctx.requests, drafts)) if _cuttable(req, d)), None)
            if i is not None:
                keep[i] = len(drafts[i])
            return keep
        if self.cost.needs_plain():
            self._forced = True    # a step without drafts now and then: keeps the jump measured
            return keep
        # every cuttable token as (-p, depth, row), p its chance of acceptance (the product of its
        # own and its ancestors' rates) times `calibration` where that is under 1. The rates are
        # learned from the tokens the cut kept, picked for reading high, and read high (lookahead
        # at batch 8: the target accepted under what its kept tokens expected in most category runs
        # of docs/results on every host, median 0.95): priced as read, the tokens just over the bar are
        # verified at a loss. Never scaled up: a model that reads low costs no verified draft.
        # Plain lists: a step has tens of tokens, not thousands.
        cal = min(self.calibration(), 1.0)
        items: list[tuple[float, int, int]] = []
        reach: list[float] = []                    # summed p per depth
        chance: dict[int, list[float]] = {}        # row -> its tokens' p
        for i, (req, d, c) in enumerate(zip(ctx.requests, drafts, classes)):
            if not _cuttable(req, d):
                continue
            rate = self._row_rates.get(req.req_id) or self.accept.rates(req.req_id, self.accept.global_rate()).tolist()
            chance[i] = chances(rate, c[:len(d)])
            for j, p in enumerate(chance[i]):
                items.append((-p * cal, j, i))
                if j < len(reach):
                    reach[j] += p
                else:
                    reach.append(p)
        rows = sum(1 for d in drafts if len(d))
        depth = max((len(d) for d in drafts), default=0)
        if not items:
            self._reach = [0.0] * depth
            return keep
        self._reach = [x / max(rows, 1) for x in reach] + [0.0] * (depth - len(reach))   # mean per depth (`_depth`)
        fit = self.cost.fit(n, self.context)
        # Best p first; ties go to the shallower token, then to the earlier row. Only the head of
        # the order is walked: the cut stops at the first token that does not pay.
        made, extra = price_cut(items, keep, n, fit)
        if not drafting_pays(fit, n, made, extra):
            return [0] * len(drafts)
        self._last_gain = (made - n) / cal     # as the rates read: `calibration` measures them
        self._row_gain = {ctx.requests[i].req_id: chance[i][:keep[i]] for i in chance if keep[i]}
        self._threshold = fit.token(n + extra) * made / (fit.seconds(n + extra) + fit.jump)
        if self.explore_every and self.steps % self.explore_every == 0 and extra:   # never pays the jump alone
            rows = [i for i, d in enumerate(drafts) if keep[i] < len(d) and _cuttable(ctx.requests[i], d)]
            if rows:
                i = rows[(self.steps // self.explore_every) % len(rows)]
                keep[i] += 1
                self.goodput_stats["explored"] += 1
        return keep

    # one clock for goodput and the proposer it wraps: the proposer's one-off seconds are subtracted
    # from the seconds goodput measures
    @property
    def clock(self):
        return self.inner.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.inner.clock = clock

    def goodput_state(self) -> dict:
        """The cost fit (`StepCost.coef`: b2 the price of a verified token past `KNEE`), the learned
        global rates per class, and the drafter accounting."""
        w = self.cost.coef()
        return {"cost_a_b_p_c0_c1_e_b2_s": None if w is None else [float(x) for x in w],
                "rates": [round(x, 4) for x in self.accept.global_rate().tolist()],
                "tries": [round(x, 1) for x in self.accept.tries.tolist()],
                "buckets": {str(k): dict(v) for k, v in sorted(self.buckets.items())},
                # per tenth of chance: [kept tokens, their mean chance, the share accepted]
                "reliability": [[n, round(sp / n, 3), round(hit / n, 3)] if n else [0, None, None]
                                for n, sp, hit in self.reliability],
                **self.goodput_stats}

    # ---- the proposer interface: the wrapped proposer's state, and goodput's own ---------------
    def request_ids(self) -> set[str]:
        return self.inner.request_ids()

    def state_nbytes(self, req_id: str) -> int:
        return self.inner.state_nbytes(req_id)

    def summary(self) -> dict:
        return {**self.inner.summary(), "goodput": self.goodput_state()}

    def counters(self) -> dict:
        return self.inner.counters()

    def set_sync(self, sync) -> None:
        self.sync = sync
