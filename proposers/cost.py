"""A step's measured cost, fitted online: what `goodput` and `bandit_tree` price drafts with."""
from __future__ import annotations

import math
from typing import NamedTuple


def continues(prev_ids: set, requests) -> tuple[set, bool]:
    """(this step's request ids, whether the time since the previous step is a step's cost): when
    no row of this step ran in the previous one, the engine may have sat idle in between (no
    requests; interleaved benchmarks, sparse traffic), and that gap must not price anything."""
    ids = {r.req_id for r in requests}
    return ids, bool(ids & prev_ids)


def batch_bucket(b: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two <= b."""
    return 1 << (max(b, 1).bit_length() - 1)


#: context the `kv` feature is counted in: thousands of (query token, context token) pairs
KV_UNIT = 1000.0


def attended(requests) -> float:
    """The `kv` feature of a step: per decoding row, its query tokens (1 + verified drafts) times
    its context length, in thousands (prefilling rows are left to the token term)."""
    return sum((1 + len(r.drafts)) * len(r.token_ids) for r in requests if r.sampled) / KV_UNIT


def mean_context(rows) -> float:
    """Mean context length of decoding rows `rows` (non-empty): what one more query token attends
    to, `StepCost.fit`'s `context`."""
    return sum(len(r.token_ids) for r in rows) / len(rows)


def step_features(ctx) -> dict:
    """The cost features of the step that just finished (`ctx`), as `StepCost.observe`,
    `predict` and `features` take them: tokens run, whether it verified drafts, rows, attention
    read (`attended`), and its prefill tokens (the tokens run beyond 1 + verified drafts per row)."""
    tokens = ctx.tokens_run()
    return {"tokens": tokens, "drafts": any(r.drafts for r in ctx.requests), "rows": len(ctx.requests),
            "kv": attended(ctx.requests),
            "prefill": max(tokens - sum(1 + len(r.drafts) for r in ctx.requests), 0)}


#: decoding query tokens in a step (rows plus verified drafts) up to which its time hardly grows.
#: On this CPU backend in bf16 at batch 1 (AVX-512) a step verifying 1-5 drafts took 0.95-1.08x a
#: plain step and 6 / 8 / 16 drafts 1.07x / 1.16x / 1.51x: flat, then ~0.9 ms a token.
#: Priced by one line through both parts, the first drafts look dear and long chains cheap;
#: `StepCost` fits a slope on either side of the knee (equal where the time is one line: float32
#: on AVX2).
KNEE = 6


class Price(NamedTuple):
    """What a step costs at one batch size and context (`StepCost.fit`): a step whose decoding
    rows run q query tokens takes `seconds(q)` = a + b * q + h * max(q - KNEE, 0), plus `jump` if
    it verifies any draft: b a token's price up to the knee, b + h past it."""
    a: float
    b: float
    jump: float
    h: float = 0.0

    def seconds(self, q: float) -> float:
        return self.a + self.b * q + self.h * max(q - KNEE, 0.0)

    def more(self, q: float, k: float) -> float:
        """Seconds that k more query tokens add to a step of q."""
        return self.b * k + self.h * (max(q + k - KNEE, 0.0) - max(q - KNEE, 0.0))

    def token(self, q: float) -> float:
        """The price of one more query token in a step of q: the marginal cost."""
        return self.b + (self.h if q >= KNEE else 0.0)

    def cheapest(self, q: float) -> float:
        """The lowest price of any token more in a step of q (a bound: `Goodput._reachable`)."""
        return self.b + min(self.h, 0.0) if q < KNEE else self.b + self.h


class StepCost:
    """seconds = a + b * min(Q, KNEE) + b' * max(Q - KNEE, 0) + p * P + D * (c0 + c1 * B) + e * KV:
    Q the decoding rows' query tokens (1 + verified drafts each), P prefill tokens, D = 1 if the
    step verified drafts, B rows, KV the attention the decoding rows read (`attended`: query
    tokens x context; 0 where the caller does not pass it). b is the price of one more verified
    draft up to `KNEE` query tokens, b' past it. A prefill token has its own price: it
    runs in one large matrix product with its prompt, and costs about half a verified draft here
    (~0.6 against ~1.2 ms at batch 8); priced alike, a fit over traffic that prefills takes b for
    a prefill token's price and a per-row jump makes up the rest, so a few drafts look dear and
    many look cheap. The jump D * (c0 + c1 * B) is what any speculation costs a step beyond its
    tokens. KV separates a long-context step from a short one with the same tokens: at batch 16 a
    summary's step costs ~2x a chat step here, and without it the arms of a bandit pulled during
    one kind of traffic were priced against steps of the other. Discounted least squares; b, b'
    and p are shrunk towards mean / 32, the jump and e towards 0 while the data cannot tell them
    apart. Where every step is past the knee (batch 8 here) only b' is measured, and it prices
    every token such a step verifies; where none is, b prices them all until one goes past."""

    #: the features of one step (`features`): 1, min(Q, KNEE), P, D, D * B, KV, max(Q - KNEE, 0)
    N_FEATURES = 7

    def __init__(self, discount: float = 0.99, prior_tokens: float = 32.0,
                 ridge: tuple[float, ...] = (4.0, 16.0, 1.0, 16.0, 256.0, 4.0), bend: float = 4.0):
        self.g, self.prior_tokens = discount, prior_tokens
        self.ridge = (0.0, *ridge)             # per feature (the constant's is 0)
        self.bend = bend                       # on b' - b: one line until the data show a knee
        n = self.N_FEATURES
        # Plain lists, not numpy: this runs between two forward passes, where code and data the
        # pass evicted make tiny library calls dear. In the engine numpy's LAPACK solve of a 6x6
        # system like this one took 80-100 us a step (~5 us timed alone), `solve_spd` ~60 us; the
        # rank-one update below half what numpy's took there.
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.n = 0
        self.plain_weight = 0.0        # discounted count of steps without drafts
        self.weight = 0.0              # discounted count of all steps
        self._w: list[float] | None = None

    def observe(self, tokens: float, seconds: float, drafts: bool = False, rows: int = 1, kv: float = 0.0,
                prefill: float = 0.0) -> None:
        if seconds <= 0 or (drafts and prefill):
            # Not a step that verified drafts beside a prefill chunk: its seconds are mostly the
            # chunk's, whose price the fit knows least (attention over a prompt grows faster than
            # its tokens), and that error, present only where drafts are, lands on the jump. With
            # verification capped at AVX2, batch 8: 6 such steps of 96 drafting ones raised a chat
            # jump from 6.2 to 11.5 ms, and through the rate every draft's bar fell (`price_cut`).
            return
        if self.n >= 16:                       # one stall (GC, another process) must not set the price
            seconds = min(seconds, 3.0 * self.predict(tokens, drafts, rows, kv, prefill))
        x, g = self.features(tokens, drafts, rows, kv, prefill), self.g
        for xi, row in zip(x, self.xtx):
            row[:] = [r * g + xi * xj for r, xj in zip(row, x)]
        self.xty = [y * g + xi * seconds for y, xi in zip(self.xty, x)]
        self.plain_weight = self.plain_weight * g + (not drafts)
        self.weight = self.weight * g + 1.0
        self.n += 1
        self._w = None

    def needs_plain(self, least: float = 0.5, cold: float = 2.0, share: float = 0.25) -> bool:
        """Whether the next step should verify no drafts, so that a plain step's cost stays measured
        (the rate without drafts is priced from it): while the discounted count of plain steps is
        under `least`, or, on a cold fit, under `share` of the drafting steps' until it reaches
        `cold` (the first steps of a server that drafts from its first request on would otherwise
        price a plain step from the drafting ones: a, b and the jump are confounded there)."""
        pw = self.plain_weight
        return self.n > 0 and (pw < least or pw < min(cold, share * (self.weight - pw)))

    def coef(self) -> list[float] | None:
        """[a, b, p, c0, c1, e, b'] (all but a >= 0), or None before the first observation."""
        if self.n == 0:
            return None
        if self._w is None:
            m = self.xty[0] / self.xtx[0][0] / self.prior_tokens
            prior = (0.0, m, m, 0.0, 0.0, 0.0, m)
            lhs = [[v + (r + 1e-9 if i == j else 0.0) for j, v in enumerate(row)]
                   for i, (row, r) in enumerate(zip(self.xtx, self.ridge))]
            for i, j, sign in ((1, 1, 1.0), (6, 6, 1.0), (1, 6, -1.0), (6, 1, -1.0)):
                lhs[i][j] += sign * self.bend
            w = solve_spd(lhs, [y + r * w0 for y, r, w0 in zip(self.xty, self.ridge, prior)])
            self._w = [w[0], *(max(x, 0.0) for x in w[1:])]
        return list(self._w)

    def fit(self, rows: int = 1, context: float = 0.0) -> Price | None:
        """The `Price` of a step of `rows` decoding rows (its jump at that many rows) in plain
        floats (callers' state crosses processes over msgpack), or None before the first
        observation; with `context` (mean context length of the decoding rows) b is the price of
        one more query token at that context: b + e * context."""
        w = self.weights()
        return None if w is None else Price(w[0], w[1] + w[5] * context / KV_UNIT, w[3] + w[4] * rows, w[6] - w[1])

    def weights(self) -> list[float] | None:
        """[a, b, p, c0, c1, e, b'] as plain floats, a >= 0: predict = weights . features."""
        w = self.coef()
        if w is not None:
            w[0] = max(w[0], 0.0)
        return w

    @staticmethod
    def features(tokens: float, drafts: bool = False, rows: int = 1, kv: float = 0.0,
                 prefill: float = 0.0) -> list[float]:
        """`tokens`: all the step ran, `prefill` of them prompt tokens."""
        q = float(tokens) - float(prefill)
        return [1.0, min(q, KNEE), float(prefill), float(drafts), float(drafts) * rows, float(kv), max(q - KNEE, 0.0)]

    def predict(self, tokens: float, drafts: bool = False, rows: int = 1, kv: float = 0.0,
                prefill: float = 0.0) -> float:
        w = self.weights()
        return 0.0 if w is None else sum(a * x for a, x in zip(w, self.features(tokens, drafts, rows, kv, prefill)))


def solve_spd(m: list[list[float]], v: list[float]) -> list[float]:
    """x with m x = v, m symmetric positive definite (a small one: lists): Cholesky, then the two
    triangular solves."""
    n = len(v)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        li = low[i]
        for j in range(i + 1):
            lj = low[j]
            t = m[i][j] - sum(li[k] * lj[k] for k in range(j))
            li[j] = math.sqrt(max(t, 1e-300)) if i == j else t / lj[j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (v[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x
