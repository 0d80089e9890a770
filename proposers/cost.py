"""A step's measured cost, fitted online: what `goodput` and `bandit_tree` price drafts with."""
from __future__ import annotations

import numpy as np


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


class StepCost:
    """seconds = a + b * T + D * (c0 + c1 * B) + e * KV: T tokens run, D = 1 if the step verified
    drafts, B rows, KV the attention the decoding rows read (`attended`: query tokens x context;
    0 where the caller does not pass it). The jump D * (c0 + c1 * B) is what any speculation costs
    a step beyond its tokens (measured on this CPU: ~0.3-1.5 ms per row, mostly in the target's
    pass once requests carry more than one query token). KV separates a long-context step from a
    short one with the same tokens: at batch 16 a summary's step costs ~2x a chat step here, and
    without it the arms of a bandit pulled during one kind of traffic were priced against steps of
    the other. Discounted least squares; b is shrunk towards mean / 32, the jump and e towards 0
    while the data cannot tell them apart."""

    def __init__(self, discount: float = 0.99, prior_tokens: float = 32.0,
                 ridge: tuple[float, float, float, float] = (16.0, 1.0, 16.0, 256.0)):
        self.g, self.prior_tokens = discount, prior_tokens
        self.ridge = np.diag([0.0, *ridge])
        self.xtx = np.zeros((5, 5))
        self.xty = np.zeros(5)
        self.n = 0
        self.plain_weight = 0.0        # discounted count of steps without drafts
        self.weight = 0.0              # discounted count of all steps
        self._w: np.ndarray | None = None

    def observe(self, tokens: float, seconds: float, drafts: bool = False, rows: int = 1, kv: float = 0.0) -> None:
        if seconds <= 0:
            return
        if self.n >= 16:                       # one stall (GC, another process) must not set the price
            seconds = min(seconds, 3.0 * self.predict(tokens, drafts, rows, kv))
        x = np.array(self.features(tokens, drafts, rows, kv))
        self.xtx = self.xtx * self.g + np.outer(x, x)
        self.xty = self.xty * self.g + x * seconds
        self.plain_weight = self.plain_weight * self.g + (not drafts)
        self.weight = self.weight * self.g + 1.0
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

    def coef(self) -> np.ndarray | None:
        """[a, b, c0, c1, e], or None before the first observation."""
        if self.n == 0:
            return None
        if self._w is None:
            w0 = np.array([0.0, self.xty[0] / self.xtx[0, 0] / self.prior_tokens, 0.0, 0.0, 0.0])
            w = np.linalg.solve(self.xtx + self.ridge + 1e-9 * np.eye(5), self.xty + self.ridge @ w0)
            w[1:] = np.maximum(w[1:], 0.0)
            self._w = w
        return self._w

    def fit(self, rows: int = 1, context: float = 0.0) -> tuple[float, float, float] | None:
        """(a, b, jump at `rows` rows) as plain floats (callers' state crosses processes over
        msgpack), or None before the first observation; with `context` (mean context length of
        the decoding rows), b is the price of one more query token at that context: b + e * context."""
        w = self.weights()
        return None if w is None else (w[0], w[1] + w[4] * context / KV_UNIT, w[2] + w[3] * rows)

    def weights(self) -> list[float] | None:
        """[a, b, c0, c1, e] as plain floats, a >= 0: predict = weights . features."""
        w = self.coef()
        return None if w is None else [max(float(w[0]), 0.0), *(float(x) for x in w[1:])]

    @staticmethod
    def features(tokens: float, drafts: bool = False, rows: int = 1, kv: float = 0.0) -> list[float]:
        return [1.0, float(tokens), float(drafts), float(drafts) * rows, float(kv)]

    def predict(self, tokens: float, drafts: bool = False, rows: int = 1, kv: float = 0.0) -> float:
        w = self.weights()
        return 0.0 if w is None else sum(a * x for a, x in zip(w, self.features(tokens, drafts, rows, kv)))
