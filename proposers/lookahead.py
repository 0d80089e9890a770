"""Lookahead decoding (Fu et al. 2024, hao-ai-lab/LookaheadDecoding) in chain form.

The paper runs a 2-D Jacobi window (lookahead branch) and n-gram verification in one forward
pass. Here the engine verifies a single draft chain per request and hands back the target's
argmax at every verified position, which is one Jacobi iteration of whatever we drafted:

* `target_argmax[i]` is the target's guess for position `base + i` given the drafts before it,
  so the outputs past the accepted prefix are the next Jacobi guesses for the positions after
  the bonus token (the window shifts by `num_accepted + 1`, absolute positions keep it aligned).
* Every verified position also yields a genuine "token -> what the target predicted after it"
  link. Chaining such links along the diagonal of the last N-1 iterations (the paper's 2-D
  window) gives n-grams, which go into a bounded per-request pool together with the n-grams of
  the text itself.
* Proposing: prompt lookup (>= 2 tokens of context), else the pool keyed on the last token,
  else 1-token prompt lookup, repeated to extend the chain up to k tokens; positions the chain
  does not cover carry the Jacobi window's current guesses, so the window keeps iterating.

All per-step work is O(k * ngram + new tokens); memory per request is bounded by `pool_cap`.
"""
from __future__ import annotations

import sys
from collections import OrderedDict, deque

import numpy as np

from .base import Proposer, RequestStep


class NGramPool:
    """Key token -> up to `per_key` continuations (n-1 tokens); at most `cap` n-grams in all.

    Re-adding an n-gram refreshes it; both bounds evict the least recently added/refreshed.
    """

    def __init__(self, n: int, cap: int, per_key: int):
        self.n, self.cap, self.per_key = n, cap, per_key
        self._lru: OrderedDict[tuple, None] = OrderedDict()  # n-gram tuples, oldest first
        self._by_key: dict[int, list[tuple]] = {}              # key -> its n-grams, oldest first

    def add(self, gram: tuple) -> None:
        conts = self._by_key.get(gram[0])
        if conts is None:
            conts = self._by_key[gram[0]] = []
        if gram in self._lru:
            self._lru.move_to_end(gram)
            conts.remove(gram)
            conts.append(gram)
            return
        self._lru[gram] = None
        conts.append(gram)
        if len(conts) > self.per_key:
            self._drop(conts[0])
        if len(self._lru) > self.cap:
            self._drop(next(iter(self._lru)))

    def _drop(self, gram: tuple) -> None:
        del self._lru[gram]
        conts = self._by_key[gram[0]]
        conts.remove(gram)
        if not conts:
            del self._by_key[gram[0]]

    def get(self, key: int) -> list[tuple]:
        """N-grams starting with `key`, oldest first (each includes the key)."""
        return self._by_key.get(key, [])

    def size(self) -> int:
        return len(self._lru)

    __len__ = size

    def nbytes(self) -> int:
        """Approximate container + tuple bytes (token ints not counted). O(size): tests/metrics."""
        return (sys.getsizeof(self._lru) + sys.getsizeof(self._by_key)
                + sum(map(sys.getsizeof, self._by_key.values())) + sum(map(sys.getsizeof, self._lru)))


class _State:
    __slots__ = ("pool", "index", "seen", "window", "start", "levels", "rng")

    def __init__(self, p: "LookaheadProposer"):
        self.pool = NGramPool(p.ngram, p.pool_cap, p.guesses)
        self.index: OrderedDict[tuple, int] = OrderedDict()  # prompt lookup: n-gram -> next pos
        self.seen = 0             # tokens of token_ids already indexed
        self.window: list[int] = []  # Jacobi guesses for positions start, start+1, ...
        self.start = 0
        self.levels: deque = deque(maxlen=max(p.ngram - 2, 0))  # (base, drafts, argmax), oldest first
        self.rng = 0x9E3779B97F4A7C15

    def nbytes(self) -> int:
        return (self.pool.nbytes() + sys.getsizeof(self.index) + sum(map(sys.getsizeof, self.index))
                + sys.getsizeof(self.window) + sum(sys.getsizeof(d) + sys.getsizeof(a) for _, d, a in self.levels))


class LookaheadProposer(Proposer):
    needs_target_argmax = True

    def __init__(self, num_speculative_tokens: int, window: int | None = None, ngram: int = 3,
                 guesses: int = 8, pool_cap: int = 4096, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 3, vocab_size: int | None = None):
        super().__init__(num_speculative_tokens)
        k = self.k
        window = k if window is None else window

        def check(name, value, lo, hi=None, extra=""):
            bad = isinstance(value, bool) or not isinstance(value, (int, np.integer))
            if bad or value < lo or (hi is not None and value > hi):
                rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"lookahead: {name} must be an int {rng}{extra}, got {value!r}")

        check("window", window, 1, k, " (num_speculative_tokens)")
        check("ngram", ngram, 2, k + 1, " (num_speculative_tokens + 1)")
        check("pool_cap", pool_cap, 1)
        check("guesses", guesses, 1, pool_cap, " (pool_cap)")
        check("prompt_lookup_max", prompt_lookup_max, 0, None, " (0 disables prompt lookup)")
        if prompt_lookup_max:
            check("prompt_lookup_min", prompt_lookup_min, 1, prompt_lookup_max, " (prompt_lookup_max)")
        if vocab_size is not None:
            check("vocab_size", vocab_size, 1)
        self.window, self.ngram, self.guesses, self.pool_cap = int(window), int(ngram), int(guesses), int(pool_cap)
        self.pl_min, self.pl_max = (int(prompt_lookup_min), int(prompt_lookup_max)) if prompt_lookup_max else (0, 0)
        self.vocab_size = vocab_size

    def new_state(self, req: RequestStep) -> _State:
        return _State(self)

    def state_nbytes(self, req_id: str) -> int:
        st = self.states.get(req_id)
        return st.nbytes() if st is not None else 0

    # ---- observe ---------------------------------------------------------------------------
    def observe(self, st: _State, req: RequestStep) -> None:
        t = req.token_ids
        L = len(t)
        self._index_text(st, t)
        d, A = tuple(int(x) for x in req.drafts), req.target_argmax
        base = L - len(req.sampled)  # position of drafts[0] and of A[0]
        if A is None or len(A) != len(d) + 1:
            A = None
            st.levels.clear()
        else:
            A = tuple(int(x) for x in A)
            self._harvest(st, base, d, A)
            if st.levels.maxlen:
                st.levels.append((base, d, A))
        # Next Jacobi window, by absolute position: A[p - base] for the positions we drafted
        # (A[a+1:], a = num_accepted), then older guesses beyond them, then pads.
        old, old_start = st.window, st.start
        w: list[int] = []
        for p in range(L, L + self.window):
            if A is not None and p - base <= len(d):
                w.append(A[p - base])
            elif 0 <= p - old_start < len(old):
                w.append(old[p - old_start])
            else:
                break
        while len(w) < self.window:  # paper: random prompt tokens; here a deterministic LCG pick
            st.rng = (st.rng * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            w.append(int(t[(st.rng >> 33) % L]))
        st.window, st.start = w, L

    def _index_text(self, st: _State, t: np.ndarray) -> None:
        """Add the n-grams completed by tokens[seen:] to the pool and prompt-lookup index. Of a
        long prompt only the last `pool_cap` tokens are indexed: the LRU-bounded pool and index
        would evict the rest (bar repeats) anyway, and this bounds the first step's cost."""
        L, n = len(t), self.ngram
        if st.seen >= L:
            return
        st.seen = max(st.seen, L - self.pool_cap)
        s0 = max(st.seen - max(n, self.pl_max), 0)
        seg = t[s0:L].tolist()
        idx, cap = st.index, self.pool_cap * (self.pl_max - self.pl_min + 1)
        for i in range(max(st.seen, 1), L):  # token i is new
            j = i - s0
            if j + 1 >= n:
                st.pool.add(tuple(seg[j + 1 - n: j + 1]))
            for m in range(self.pl_min or 1, min(self.pl_max, i) + 1):  # m-gram ending at i-1 -> i
                key = tuple(seg[j - m: j])
                idx.pop(key, None)
                idx[key] = i
            while len(idx) > cap:
                idx.popitem(last=False)
        st.seen = L

    def _harvest(self, st: _State, base: int, d: tuple, A: tuple) -> None:
        """Diagonal n-grams of the Jacobi trajectory.

        Alignment (absolute positions): this step's drafts d sit at base.., A[j] is the target's
        token at base+j given d[:j], so (d[j-1] @ base+j-1, A[j] @ base+j) is a genuine link.
        Walking back one level per token: an older level (lb, ld, la) contributes ld[i] at
        position p-1 iff its own output there, la[i+1] (target's token at p after ld[:i+1]),
        equals the token we already have at p. That holds exactly for the window slots we
        carried over (and for any draft that happens to agree), whatever num_accepted was.
        """
        n, levels = self.ngram, st.levels
        for j in range(1, len(d) + 1):
            gram = [A[j], d[j - 1]]
            p = base + j - 1  # position of gram[-1]
            for lb, ld, la in reversed(levels):
                if len(gram) == n:
                    break
                i = p - 1 - lb
                if not 0 <= i < len(ld) or la[i + 1] != gram[-1]:
                    break
                gram.append(ld[i])
                p -= 1
            if len(gram) == n:
                st.pool.add(tuple(reversed(gram)))

    # ---- propose ---------------------------------------------------------------------------
    def propose_one(self, st: _State, req: RequestStep, k: int) -> list[int]:
        t = req.token_ids
        ctx = t[-max(self.pl_max, 1):].tolist()
        chain: list[int] = []
        while len(chain) < k:
            ext = self._extend(st, t, (ctx + chain)[-len(ctx):], k - len(chain))
            if not ext:
                break
            chain += ext
        drafts = chain + st.window[len(chain):min(self.window, k)]
        if self.vocab_size is not None:
            for i, x in enumerate(drafts):
                if not 0 <= x < self.vocab_size:
                    return drafts[:i]
        return drafts[:k]

    def _extend(self, st: _State, t: np.ndarray, ctx: list[int], r: int) -> list[int]:
        ext = self._lookup(st, t, ctx, r, max(self.pl_min, 2))  # text match with >= 2 tokens of context
        if ext:
            return ext
        grams = st.pool.get(ctx[-1])  # Jacobi/text n-grams: most recent wins
        if grams:
            return list(grams[-1][1:r + 1])
        return self._lookup(st, t, ctx, r, 1) if self.pl_min == 1 else []

    def _lookup(self, st: _State, t: np.ndarray, ctx: list[int], r: int, lo: int) -> list[int]:
        """Prompt lookup as `ngram_lookup`, via the incremental index (latest occurrence)."""
        for m in range(min(self.pl_max, len(ctx)), lo - 1, -1):
            pos = st.index.get(tuple(ctx[-m:]))
            if pos is not None:
                return t[pos:pos + r].tolist()
        return []
