"""Lookahead decoding (Fu et al. 2024, hao-ai-lab/LookaheadDecoding): chain form, and the full
(tree) form below.

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
* Proposing: prompt lookup (>= 2 tokens of context; of the occurrences, the longest match's
  most frequent continuation, as suffix decoding), else the shared n-gram table and the pool
  keyed on the last token, else 1-token prompt lookup, repeated to extend the chain up to k
  tokens; positions the chain does not cover carry the Jacobi window's current guesses, so the
  window keeps iterating.

All per-step work is O(k * (ngram + OCCURRENCES * MATCH_DEPTH) + new tokens); memory per request
is bounded by `pool_cap`.

Full form (`tree=True`, Fu et al. 2024 section 3): where the engine can verify a draft tree for
a request (`req.tree_ok`; else the chain form's chain), each step drafts one `DraftTree` of at
most min(tree_nodes, k) nodes carrying both of the paper's branches, so one target pass verifies
and iterates:

* verification branch: the chain form's chain (prompt lookup / pool, extended up to the budget),
  the pool's other n-grams keyed on the last token (most recent first, up to G) and the 1-token
  prompt-lookup match, merged as a trie (shared prefixes share nodes);
* lookahead branch: the Jacobi window (W guesses) after the chain, as the chain form drafts it
  (chain + window[len(chain):], `window_at="chain"`, the default). Alternatives, kept for
  measurement: "root" hangs the window off the root (the paper's layout), "both" carries both.

Node order (what the node cap and the scheduler's prefix cut keep): every node is scored with
its estimated probability of acceptance, P(parent accepted) * P(accepted | parent accepted),
the second factor per node class (source of the token, whether it is where its candidate
leaves a shared prefix, depth), learned per request from which nodes of the verified trees were
reachable and accepted (decayed counts over priors). Best first; a child never outscores its
parent and ties go to the older node, so the order is topological and every prefix is a tree.

Harvest from a verified tree (O(tree size * N)): the lookahead branch that shares most nodes
with the accepted path gives the chain form's diagonal n-grams and the next Jacobi window (by
absolute position); every other node i gives "last N-1 tokens of root context + path(i)" + the
target's token after path(i) (row 1+i), kept only if every link inside is genuine (the child
token is the target's own output after its parent in this pass).
"""
from __future__ import annotations

import heapq
import sys
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .base import GOODPUT_HELP, BuildEnv, MethodConfig, Proposer, RequestStep, StepContext, check_prompt_lookup, key

if TYPE_CHECKING:
    from vllm_spec_plugins.scorers.tree import DraftTree


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


class SharedPool:
    """The text of every request (prompts and outputs, all verified tokens), shared across
    requests: context of 1..`n`-1 tokens -> how often each next token followed it. The chain
    form's fallback when the request's own text has no >= 2-token match: answers of one model
    repeat its phrasing across requests. Bounded: at most `cap`
    contexts (least recently extended goes first), `per_key` next tokens each (the least
    counted goes, ties: the oldest). Contexts are keyed by tenant (vLLM's `cache_salt`): text of
    one request shapes the drafts of requests of its own tenant only (never the output; the speed,
    as a shared prefix cache does). `shared_pool: 0` turns it off. A match over the whole text of
    other requests (suffix decoding's global tree: a continuation after up to `MATCH_DEPTH` tokens
    of agreement) did not pay, replayed over the held-out split at batch 8: in this table's place
    1.5% slower on every category, beside it 1.6% faster on code and 0.5-1.3% slower on chat and
    summaries, tau within 0.05 either way."""

    def __init__(self, n: int, cap: int, per_key: int = 4):
        self.n, self.cap, self.per_key = n, cap, per_key
        self._tab: OrderedDict[tuple, dict[int, int]] = OrderedDict()

    def add(self, seg: list[int], start: int, tenant: str | None = None) -> None:
        """Tokens seg[start:] are new (seg holds up to n-1 tokens of context before them)."""
        tab, per_key, pre = self._tab, self.per_key, (() if tenant is None else (tenant,))
        for i in range(max(start, 1), len(seg)):
            x = seg[i]
            for m in range(1, min(self.n - 1, i) + 1):
                key = pre + tuple(seg[i - m:i])
                d = tab.get(key)
                if d is None:
                    d = tab[key] = {}
                else:
                    tab.move_to_end(key)
                d[x] = d.get(x, 0) + 1
                if len(d) > per_key:
                    del d[min(d, key=d.__getitem__)]
        while len(tab) > self.cap:
            tab.popitem(last=False)

    def best(self, ctx: list[int], lo: int, hi: int, tenant: str | None = None) -> tuple[int, int, int] | None:
        """The most counted next token after the longest suffix of ctx (hi..lo tokens) seen, in
        the text of `tenant`'s requests, how often it followed that context and how often any
        token did."""
        pre = () if tenant is None else (tenant,)
        for m in range(min(hi, self.n - 1, len(ctx)), lo - 1, -1):
            d = self._tab.get(pre + tuple(ctx[-m:]))
            if d:
                x = max(reversed(d), key=d.__getitem__)   # ties: the latest added
                return x, d[x], sum(d.values())
        return None

    def __len__(self) -> int:
        return len(self._tab)

    def nbytes(self) -> int:
        """Approximate container bytes (token ints not counted). O(size): tests/metrics."""
        return (sys.getsizeof(self._tab) + sum(map(sys.getsizeof, self._tab))
                + sum(map(sys.getsizeof, self._tab.values())))


class _State:
    __slots__ = ("pool", "index", "before", "seen", "window", "start", "levels", "rng", "lpath", "proposed",
                 "tries", "hits", "touched", "step", "tenant")

    def __init__(self, p: "LookaheadProposer", tenant: str | None = None):
        self.tenant = tenant      # the shared pool's key: drafts see only their tenant's text
        self.pool = NGramPool(p.ngram, p.pool_cap, p.guesses)
        self.index: OrderedDict[tuple, int] = OrderedDict()  # prompt lookup: n-gram -> next pos
        # per n-gram length m >= vote_min: next pos -> the next pos of the m-gram's occurrence
        # before (-1: none), a ring over the last pool_cap positions (the chain form's text match
        # votes over them)
        self.before = [array("i", [-1]) * p.pool_cap for _ in range(p.vote_min, p.pl_max + 1)]
        self.seen = 0             # tokens of token_ids already indexed
        self.window: list[int] = []  # Jacobi guesses for positions start, start+1, ...
        self.start = 0
        self.levels: deque = deque(maxlen=max(p.ngram - 2, 0))  # (base, drafts, argmax), oldest first
        self.rng = 0x9E3779B97F4A7C15
        # tree form only
        self.lpath: list[list[int]] = []  # lookahead branches drafted last step (from position start)
        self.proposed: tuple | None = None  # (tokens, parents, node classes, node scores) drafted last step
        self.tries: list[float] | None = None  # per node class: decayed reach / accept counts
        self.hits: list[float] | None = None
        self.touched: list[int] | None = None
        self.step = 0

    def nbytes(self) -> int:
        tree = sum(sys.getsizeof(x) for x in (self.tries, self.hits, self.touched, self.lpath) if x is not None)
        tree += sum(map(sys.getsizeof, self.lpath)) + (sum(map(sys.getsizeof, self.proposed)) if self.proposed else 0)
        return (self.pool.nbytes() + sys.getsizeof(self.index) + sum(map(sys.getsizeof, self.index))
                + sum(map(sys.getsizeof, self.before))
                + sys.getsizeof(self.window) + sum(sys.getsizeof(d) + sys.getsizeof(a) for _, d, a in self.levels)
                + tree)


SHARED_POOL_HELP = ("contexts kept in the n-gram table shared by all requests (every request's prompt and "
                    "output; LRU), kept apart per tenant: requests with another cache_salt never draft from "
                    "each other's text; 0 = off (each request drafts from its own text only)")


@dataclass
class LookaheadConfig(MethodConfig):
    method = "lookahead"
    num_speculative_tokens: int = key(16, 1, 64, "max draft chain length (k; goodput keeps what pays)")
    window: int = key(0, 0, 64, "Jacobi window W (guess positions; 0 = num_speculative_tokens)")
    ngram: int = key(4, 2, 16, "n-gram size N (lookahead levels + 1)")
    guesses: int = key(7, 1, 64, "G: max n-gram candidates kept per key token")
    pool_cap: int = key(4096, 16, 1 << 20, "max n-grams per request (LRU eviction)")
    shared_pool: int = key(65536, 0, 1 << 22, SHARED_POOL_HELP)
    prompt_lookup_min: int = key(1, 1, 16, "prompt-lookup fallback: min match length")
    prompt_lookup_max: int = key(3, 1, 16, "prompt-lookup fallback: max match length")
    tree: bool = key(False, help="full form: verify pool candidates + Jacobi window as one tree")
    tree_nodes: int = key(0, 0, 64, "tree node budget (0 = num_speculative_tokens)")
    goodput: bool = key(True, help=GOODPUT_HELP)

    def check(self) -> None:
        check_prompt_lookup(self)
        if self.guesses > self.pool_cap:
            raise ValueError(f"speculative_config.guesses={self.guesses} must be <= pool_cap={self.pool_cap}")
        k = self.num_speculative_tokens
        for name, hi, what in (("window", k, "num_speculative_tokens"),
                               ("tree_nodes", k, "num_speculative_tokens (the scheduler's draft budget)"),
                               ("ngram", k + 1, "num_speculative_tokens + 1")):
            if getattr(self, name) > hi:
                raise ValueError(f"speculative_config.{name}={getattr(self, name)} must be <= {what} = {hi}")

    @property
    def uses_trees(self) -> bool:
        return self.tree

    def build(self, env: BuildEnv) -> Proposer:
        prop = LookaheadProposer(self, vocab_size=env.vocab_size)
        if self.goodput and not self.tree:        # chains; the tree form keeps its tree_nodes
            from .goodput import Goodput
            return Goodput(prop)
        return prop


class LookaheadProposer(Proposer):
    needs_target_argmax = True
    depth_free = True                           # a chain is lookups: its length costs next to nothing
    clock = staticmethod(time.perf_counter)     # `once_seconds` (a `Goodput` around it sets its own)

    def __init__(self, cfg: LookaheadConfig, vocab_size: int | None = None):
        super().__init__(cfg.num_speculative_tokens)
        self.cfg = cfg
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"lookahead: vocab_size must be >= 1, got {vocab_size!r}")
        k = self.k
        self.tree, self.tree_nodes = cfg.tree, cfg.tree_nodes or k
        self.window, self.ngram, self.guesses, self.pool_cap = cfg.window or k, cfg.ngram, cfg.guesses, cfg.pool_cap
        self.pl_min, self.pl_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.vote_min = max(self.pl_min, 2)     # the chain form's text match: >= 2 tokens of context
        self.vocab_size = vocab_size
        self.shared = SharedPool(self.ngram, cfg.shared_pool) if cfg.shared_pool else None
        # req id -> tokens of its text the shared pool has taken: a preempted request comes back
        # with a fresh state and must not add its text twice (LRU-bounded; ids are unique)
        self._fed: OrderedDict[str, int] = OrderedDict()
        # seconds spent indexing new requests' prompts (up to pool_cap tokens each): one-off work
        # per request, not a step's drafting cost (`Goodput`, `bandit_tree` and `cascade` read it)
        self.once_seconds = 0.0

    _FED_CAP = 8192

    def new_state(self, req: RequestStep) -> _State:
        return _State(self, req.tenant)

    def propose(self, ctx: StepContext) -> list:
        """A step with no draft budget (back-off, goodput, vLLM's schedule) skips the per-request
        work: the text index is incremental and the Jacobi window positional, so the next step
        that drafts catches up. The tree form keeps its per-step statistics and observes always."""
        if self.tree or ctx.budget(self.k):
            return super().propose(ctx)
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        self.classes = [[] for _ in ctx.requests]
        return [[] for _ in ctx.requests]

    def state_nbytes(self, req_id: str) -> int:
        st = self.states.get(req_id)
        return st.nbytes() if st is not None else 0

    def summary(self) -> dict:
        if self.shared is None:
            return {}
        return {"shared_pool": {"contexts": len(self.shared), "cap": self.shared.cap}}   # bounded, never freed

    # ---- observe ---------------------------------------------------------------------------
    def observe(self, st: _State, req: RequestStep) -> None:
        if self.tree:
            if req.tree_parents is not None:
                return self._observe_tree(st, req)
            # a chain: our tree cut to a chain (scheduler), or a chain we drafted (not tree_ok)
            proposed, st.proposed = st.proposed, None
            n = len(req.drafts)
            if proposed is not None and n and list(proposed[0][:n]) == [int(x) for x in req.drafts] \
                    and list(proposed[1][:n]) == list(range(-1, n - 1)):
                self._update_stats(st, list(range(-1, n - 1)), set(range(req.num_accepted)), proposed[2])
        t = req.token_ids
        L = len(t)
        if st.seen:
            self._index_text(st, t, req.req_id)
        else:
            t0 = self.clock()
            self._index_text(st, t, req.req_id)
            self.once_seconds += self.clock() - t0
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
        self._shift_window(st, t, base, d, A)

    def _shift_window(self, st: _State, t: np.ndarray, base: int, d: tuple, A: tuple | None) -> None:
        """Next Jacobi window, by absolute position: A[p - base] for the positions we drafted
        (A[a+1:], a = num_accepted), then older guesses beyond them, then pads."""
        L, W = len(t), self.window
        old, old_start = st.window, st.start
        w = list(A[L - base:len(d) + 1][:W]) if A is not None else []
        i = L + len(w) - old_start          # the old window's index of the next position
        if len(w) < W and 0 <= i < len(old):
            w += old[i:i + W - len(w)]
        while len(w) < W:  # paper: random prompt tokens; here a deterministic LCG pick
            st.rng = (st.rng * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            w.append(int(t[(st.rng >> 33) % L]))
        st.window, st.start = w, L

    def _index_text(self, st: _State, t: np.ndarray, req_id: str) -> None:
        """Add the n-grams completed by tokens[seen:] to the pool and prompt-lookup index. Of a
        long prompt only the last `pool_cap` tokens are indexed: the LRU-bounded pool and index
        would evict the rest (bar repeats) anyway, and this bounds the first step's cost."""
        L, n = len(t), self.ngram
        if st.seen >= L:
            return
        st.seen = max(st.seen, L - self.pool_cap)
        s0 = max(st.seen - max(n, self.pl_max), 0)
        seg = t[s0:L].tolist()
        idx, cap, ring, vm = st.index, self.pool_cap * (self.pl_max - self.pl_min + 1), self.pool_cap, self.vote_min
        for i in range(max(st.seen, 1), L):  # token i is new
            j = i - s0
            if j + 1 >= n:
                st.pool.add(tuple(seg[j + 1 - n: j + 1]))
            for m in range(self.pl_min, min(self.pl_max, i) + 1):  # m-gram ending at i-1 -> i
                key = tuple(seg[j - m: j])
                last = idx.pop(key, -1)
                if m >= vm:
                    st.before[m - vm][i % ring] = last
                idx[key] = i
            while len(idx) > cap:
                idx.popitem(last=False)
        if self.shared is not None:
            fed = self._fed.pop(req_id, 0)
            if fed < L:
                self.shared.add(seg, max(st.seen, fed, 1) - s0, st.tenant)
            self._fed[req_id] = max(fed, L)
            if len(self._fed) > self._FED_CAP:
                self._fed.popitem(last=False)
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
    def propose_one(self, st: _State, req: RequestStep, k: int) -> "list[int] | DraftTree":
        if self.tree and req.tree_ok:
            return self.propose_tree(st, req, k)
        drafts, self._classes = self.chain_draft(st, req, k)
        return drafts

    def chain_draft(self, st: _State, req: RequestStep, k: int) -> tuple[list[int], list[int]]:
        """The chain form's draft of up to k tokens (the chain, then the Jacobi window's guesses
        past it, cut before any token outside the vocabulary) and each token's class
        (`class_prior`'s, for `Goodput`)."""
        chain, srcs, starts = self._classed_chain(st, req.token_ids, k)
        drafts = (chain + st.window[len(chain):min(self.window, k)])[:k]
        classes = self._token_classes(srcs, starts, len(chain), len(drafts))
        if self.vocab_size is not None:
            bad = next((i for i, x in enumerate(drafts) if not 0 <= x < self.vocab_size), len(drafts))
            drafts, classes = drafts[:bad], classes[:bad]
        return drafts, classes

    def chain(self, st: _State, t: np.ndarray, k: int) -> list[int]:
        """The chain form's chain over text `t`, without the Jacobi window (a cascade's level 0)."""
        return self._chain(st, t, t[-max(self.pl_max, 1):].tolist(), k)

    def classed_chain(self, st: _State, t: np.ndarray, k: int) -> tuple[list[int], list[int]]:
        """The chain form's chain over text `t` without the window, and its token classes
        (`class_prior`'s): a cascade's level 0 drafting for the target alone."""
        chain, srcs, starts = self._classed_chain(st, t, k)
        return chain, self._token_classes(srcs, starts, len(chain), len(chain))

    def _classed_chain(self, st: _State, t: np.ndarray, k: int) -> tuple[list[int], list[int], list[int]]:
        """The chain form's chain, each token's source and where each extension starts (`_chain`)."""
        srcs: list[int] = []
        starts: list[int] = []
        return self._chain(st, t, t[-max(self.pl_max, 1):].tolist(), k, srcs, starts, matches=True), srcs, starts

    def _token_classes(self, srcs: list[int], starts: list[int], m: int, n: int) -> list[int]:
        """Classes of n drafts whose first m are the chain (for `Goodput`): the tree form's (source,
        continuation, depth) scheme, the window tail as source 3, the shared pool's tokens 4 (7 / 8
        where agreed / contested, `SURE`), a long text match's 5, a short match's tokens past its
        agreement 6."""
        D, first = self._DEPTHS, set(starts) | {m}
        return [(2 * (srcs[j] if j < m else 3) + (j not in first)) * D + min(j, D - 1) for j in range(n)]

    #: tokens of context that must agree at the occurrence a text match drafts from for its
    #: tokens to be a class of their own (source 5): replayed over the fresh prompts, a match that
    #: agrees over 8 or more tokens had its first token accepted 0.9-1.0 of the time, one over 2
    #: ~0.5-0.65. `Goodput` prices each class by its own measured rate, so the long match's chain
    #: is kept deep. A shorter match's tokens past the ones it agrees over (suffix decoding's
    #: draft length scaled by match length, factor 1) are a class of their own too (source 6):
    #: priced at their own rate, not at that of matches that agree over more, they are kept where
    #: a verified token is cheap and cut where it is dear. Replayed over the held-out split
    #: (`scripts/goodput_replay.py`) against cutting such a match at its agreement: batch 1 ran
    #: 0.5-3% faster, batch 8 within 1% (cost models of an AVX-512 bf16 and an AVX2 float32 host).
    LONG_MATCH = 8

    #: the chain form's text match, as suffix decoding's (vLLM's `suffix` method): among the
    #: latest `OCCURRENCES` occurrences of the last tokens, those agreeing with the text over the
    #: most tokens (up to `MATCH_DEPTH`, suffix decoding's tree depth), and their most frequent
    #: continuation. Replayed over the held-out split (four request orders at batch 8, two at
    #: batch 1) against the latest occurrence of the last 3 tokens: batch 8 chat -0.6%, code -1.4%
    #: time, summaries tau +0.06; batch 1 code -1.6%, chat and summaries within 0.1%.
    OCCURRENCES = 16
    MATCH_DEPTH = 24

    #: the shared pool's tokens are classed by how often the text of all requests agrees on them
    #: (suffix decoding's frequency-weighted confidence): a token that followed its context at
    #: least `SURE[0]` times and in at least `SURE[1]` of them is source 7, one that followed it in
    #: under `CONTESTED` of them source 8, others (most seen once) source 4. Priced at their own
    #: measured rates, agreed tokens are kept deeper and contested ones cut sooner. Replayed over
    #: the held-out split at batch 8 (an AVX-512 bf16 host's cost model) against one class for all:
    #: tau +0.02-0.03 on every category.
    SURE = (2, 0.7)
    CONTESTED = 0.5
    SHARED_SOURCES = (4, 7, 8)   # every source `_shared_source` gives

    def _shared_source(self, hit: tuple[int, int, int]) -> int:
        _, count, total = hit
        if total >= self.SURE[0] and count >= self.SURE[1] * total:
            return 7
        return 8 if count < self.CONTESTED * total else 4

    def _chain(self, st: _State, t: np.ndarray, ctx: list[int], k: int, srcs: list[int] | None = None,
               starts: list[int] | None = None, matches: bool = False) -> list[int]:
        """The chain form's candidate: `_extend` repeated up to k tokens. `srcs`, if given,
        receives each token's source (0: prompt lookup, >= 2 tokens of context; 1: pool; 2:
        1-token prompt lookup; 4, 7, 8: the shared pool; 5: prompt lookup agreeing over `LONG_MATCH`
        tokens; 6: a shorter match's tokens past its agreement); `starts` the index where each
        extension begins. `matches`: measure each text match's agreement (sources 5 and 6): the
        chain form's drafts."""
        chain: list[int] = []
        back = t[-self.MATCH_DEPTH:].tolist() if matches else None
        while len(chain) < k:
            ext = self._extend(st, t, (ctx + chain)[-len(ctx):], k - len(chain), srcs,
                               None if back is None else (back + chain)[-self.MATCH_DEPTH:])
            if not ext:
                break
            if starts is not None:
                starts.append(len(chain))
            chain += ext
        return chain

    def _extend(self, st: _State, t: np.ndarray, ctx: list[int], r: int, srcs: list[int] | None = None,
                back: list[int] | None = None) -> list[int]:
        """The request's own text (>= 2 tokens of context), the shared pool (>= 2), the request's
        Jacobi/text pool, the shared pool (1 token of context), its own text (1 token). The
        shared pool gives one token per call, so the request's own text is tried again after it.
        `back`: the last `MATCH_DEPTH` tokens before the extension (text and chain so far); with
        it a text match's agreement sets its classes (sources 5 and 6)."""
        ext, agree = self._lookup(st, t, ctx, r, self.vote_min, back)   # >= 2 tokens of context
        src, shared, over = 0, self.shared, 0
        if ext and back is not None:
            if agree >= self.LONG_MATCH:
                src = 5
            else:
                over = max(len(ext) - agree, 0)      # past what a short match agrees over
        if not ext:
            hit = shared.best(ctx, 2, len(ctx), st.tenant) if shared is not None else None
            if hit is not None:
                ext, src = [hit[0]], self._shared_source(hit)
            elif grams := st.pool.get(ctx[-1]):  # Jacobi/text n-grams: most recent wins
                ext, src = list(grams[-1][1:r + 1]), 1
            elif shared is not None and (hit := shared.best(ctx, 1, 1, st.tenant)) is not None:
                ext, src = [hit[0]], self._shared_source(hit)
            elif self.pl_min == 1:
                ext, src = self._lookup(st, t, ctx, r, 1)[0], 2
        if srcs is not None:
            srcs += [src] * (len(ext) - over) + [6] * over
        return ext

    def _lookup(self, st: _State, t: np.ndarray, ctx: list[int], r: int, lo: int,
                back: list[int] | None = None) -> tuple[list[int], int]:
        """Prompt lookup of the last lo..`prompt_lookup_max` tokens of ctx (longest first) via the
        incremental index. Without `back` (or for a match under `vote_min` tokens): the
        continuation of the latest occurrence, as `ngram_lookup`, and 0. With it (the text and
        chain so far, ending with ctx), as suffix decoding drafts from its suffix tree: of the
        occurrences, those whose text agrees with `back` over the most tokens (the longest
        match), and their most frequent continuation, token by token (ties: the latest
        occurrence's); and over how many tokens they agree."""
        L, ring = len(t), self.pool_cap
        for m in range(min(self.pl_max, len(ctx)), lo - 1, -1):
            pos = st.index.get(tuple(ctx[-m:]))
            if pos is None:
                continue
            if back is None or m < self.vote_min:
                return t[pos:pos + r].tolist(), 0
            before, best, top = st.before[m - self.vote_min], -1, []
            for _ in range(self.OCCURRENCES):     # latest first
                n = m
                while n < len(back) and pos - n - 1 >= 0 and t.item(pos - n - 1) == back[-n - 1]:
                    n += 1
                if n > best:
                    best, top = n, [pos]
                elif n == best:
                    top.append(pos)
                if pos + ring < L:                # its link is overwritten
                    break
                pos = before[pos % ring]
                if pos < 0:
                    break
            if len(top) == 1:
                return t[top[0]:top[0] + r].tolist(), best
            out = []
            for j in range(r):
                counts: dict[int, int] = {}
                for pos in top:
                    if pos + j < L:
                        x = t.item(pos + j)
                        counts[x] = counts.get(x, 0) + 1
                if not counts:
                    break
                x = max(counts, key=counts.__getitem__)
                out.append(x)
                top = [pos for pos in top if pos + j < L and t.item(pos + j) == x]
            return out, best
        return [], 0

    # ---- tree form -------------------------------------------------------------------------
    # Node classes for the per-request acceptance statistics: (source, diverge, depth), depth
    # capped at _DEPTHS. Sources: the chain form's chain, by where each token came from (0:
    # prompt lookup with >= 2 tokens of context, 1: pool, 2: 1-token prompt lookup), 3: the
    # Jacobi window after that chain (the chain form's draft tail), 4: the Jacobi window off the
    # root (the paper's lookahead branch), 4 + r: the r-th other candidate (r >= 1), then the chain
    # form's own classes of the chain's other tokens (`_tree_source`). diverge: the
    # first node a candidate adds (depth 1, or where it leaves a shared prefix), which competes
    # with its siblings; else a continuation below the candidate's own node. A node's class is
    # set by the first candidate inserted through it (insertion order of `propose_tree`).
    # Index: (2 * source + (not diverge)) * _DEPTHS + min(depth, _DEPTHS) - 1.
    _DEPTHS = 4
    # prior acceptance rates of sources 0..4: (diverge, continuation)
    _PRIOR = ((0.7, 0.9), (0.4, 0.6), (0.3, 0.5), (0.3, 0.3), (0.3, 0.5))
    _PRIOR_ALT = (0.3, 0.6)   # other candidates: rank-1 diverge (halved per rank) / continuation
    _PRIOR_WEIGHT = 4.0       # pseudo-counts behind the priors (forgetting never goes below them)
    _DECAY = 0.97             # per-step forgetting of the counts
    #: where the tree carries the Jacobi window: "chain" (after the chain-form candidate, as the
    #: chain form drafts it), "root" (off the root, the paper's lookahead branch) or "both" (each
    #: scored like any node). "chain" by default: real text echoes the chain form's candidate, and
    #: a window after it iterates on the tokens most likely to be accepted.
    window_at = "chain"
    #: prior rate of each chain-form token class (`Goodput`): index (2 * source + continuation) * D + depth
    #: (sources 0..3 as the tree form's, 4: the shared pool, 5: a text match over `LONG_MATCH` tokens,
    #: 6: a shorter match's tokens past its agreement, 7 / 8: the shared pool's agreed / contested
    #: tokens, `SURE`)
    _CHAIN_PRIOR = _PRIOR[:4] + ((0.4, 0.6), (0.9, 0.9), (0.1, 0.3), (0.7, 0.8), (0.2, 0.3))
    class_prior = np.repeat(np.array(_CHAIN_PRIOR).ravel(), _DEPTHS)
    #: the chain-form sources past the tree's own (0..2) that a tree's chain carries: they keep
    #: their classes in the tree, after the tree's other candidates (`_tree_source`)
    _CHAIN_ONLY = (4, 5, 6, 7, 8)

    def _tree_source(self, src: int) -> int:
        """The tree's source of a chain-form token of source `src`: the tree's sources 0..2 are
        the chain form's; the chain form's other classes (the shared pool's agreed / contested
        tokens, long and short text matches) follow the tree's other candidates (4 + r, r <=
        guesses + 1), so the tree prices them at their own measured rates too."""
        return src if src < 3 else self.guesses + 6 + self._CHAIN_ONLY.index(src)

    def _init_stats(self, st: _State) -> None:
        pri = list(self._PRIOR)
        for r in range(1, self.guesses + 2):
            pri.append((self._PRIOR_ALT[0] * 0.5 ** (r - 1), self._PRIOR_ALT[1]))
        pri += [self._CHAIN_PRIOR[x] for x in self._CHAIN_ONLY]
        rates = [rate for pair in pri for rate in pair for _ in range(self._DEPTHS)]
        st.tries = [self._PRIOR_WEIGHT] * len(rates)
        st.hits = [self._PRIOR_WEIGHT * q for q in rates]
        st.touched = [0] * len(rates)   # step of each class's last decay
        st.step = 0

    def _observe_tree(self, st: _State, req: RequestStep) -> None:
        """A verified tree: acceptance statistics, n-grams from every node, then the next window
        along one lookahead branch (a chain, so exactly the chain form's update)."""
        t = req.token_ids
        L = len(t)
        self._index_text(st, t, req.req_id)
        d, P, A = tuple(int(x) for x in req.drafts), req.tree_parents, req.target_argmax
        base = L - len(req.sampled)  # position of the root's children; row 0 predicts it
        n = len(d)
        proposed, st.proposed = st.proposed, None
        if A is None or len(A) != n + 1 or len(P) != n:
            st.levels.clear()
            self._shift_window(st, t, base, (), None)
            return
        A, P = tuple(int(x) for x in A), [int(p) for p in P]
        acc = [int(i) for i in req.accepted_nodes or ()]
        on = set(acc)
        if proposed is not None and list(proposed[0][:n]) == list(d) and list(proposed[1][:n]) == P:
            self._update_stats(st, P, on, proposed[2])
        # The lookahead branches: root paths spelling what we drafted from position base (a
        # prefix when the tree was cut). The one sharing most nodes with the accepted path has
        # its outputs conditioned on the most correct tokens; ties go to the first listed.
        best: list[int] = []
        if st.start == base and st.lpath:
            first: dict[tuple, int] = {}
            for i in range(n):
                first.setdefault((P[i], d[i]), i)
            best_key = None
            for path in st.lpath:
                nodes, r = [], -1
                for x in path:
                    c = first.get((r, x))
                    if c is None:
                        break
                    nodes.append(c)
                    r = c
                key = (sum(1 for c in nodes if c in on), bool(nodes))
                if best_key is None or key > best_key:
                    best, best_key = nodes, key
        dw = tuple(d[c] for c in best)
        Aw = (A[0],) + tuple(A[1 + c] for c in best)
        self._harvest_paths(st, t, base, d, P, A, on)
        self._harvest(st, base, dw, Aw)        # the branch's Jacobi diagonals, as for a chain
        if st.levels.maxlen:
            st.levels.append((base, dw, Aw))
        self._shift_window(st, t, base, dw, Aw)

    def _update_stats(self, st: _State, P: list[int], on: set[int], cls: list[int]) -> None:
        """Node i was reachable iff its parent was accepted (or is the root); count reach/accept
        per class. Counts decay by _DECAY per step, never below the prior's weight; decay scales
        a class's hits and tries alike (its rate is unchanged), so it is applied lazily to the
        classes touched: t <- max(t * decay**steps, prior weight). O(n)."""
        if st.tries is None:
            self._init_stats(st)
        st.step += 1
        lam, pw, now = self._DECAY, self._PRIOR_WEIGHT, st.step
        tries, hits, last = st.tries, st.hits, st.touched
        for i, p in enumerate(P):
            if p < 0 or p in on:
                c = cls[i]
                if last[c] != now:
                    tr = tries[c]
                    if tr > pw:
                        f = max(tr * lam ** (now - last[c]), pw) / tr
                        tries[c] = tr * f
                        hits[c] *= f
                    last[c] = now
                tries[c] += 1.0
                if i in on:
                    hits[c] += 1.0

    def _harvest_paths(self, st: _State, t: np.ndarray, base: int, d: tuple, P: list[int],
                       A: tuple, skip: set[int]) -> None:
        """Node i: the last N-1 tokens of root context + path(i), then A[1+i] (the target's token
        after path(i)). Kept only if every link inside is genuine: a node's token must be the
        target's output after its parent (d[j] == A[1+P[j]]) to link it to its parent; root
        context is committed text. Accepted nodes are skipped (their n-grams are text n-grams).
        Best nodes (low index) are added last, i.e. count as the most recent. O(n * N)."""
        N, add = self.ngram, st.pool.add
        tail = t[max(base - N, 0):base].tolist()   # tail[-1] is the root token
        for i in range(len(d) - 1, -1, -1):
            if i in skip:
                continue
            gram = [A[1 + i], d[i]]                  # newest first
            cur = i
            while len(gram) < N:
                p = P[cur]
                if d[cur] != A[p + 1]:
                    break
                if p < 0:
                    need = N - len(gram)
                    if need <= len(tail):
                        gram.extend(tail[len(tail) - 1 - j] for j in range(need))
                    break
                gram.append(d[p])
                cur = p
            if len(gram) == N:
                gram.reverse()
                add(tuple(gram))

    def propose_tree(self, st: _State, req: RequestStep, k: int, widths: "list[int] | None" = None,
                     also: "dict | None" = None, subsets: "dict | None" = None,
                     min_score: float = 0.0) -> "DraftTree | list[int]":
        """The draft tree: candidates merged as a trie, each node scored with its estimated
        probability of acceptance, the best `min(tree_nodes, k)` nodes kept, in `shaped_tree`'s
        order (the best path, then best first).
        `widths` (a shape: at most widths[d] nodes at depth d+1, depth <= len(widths)) keeps,
        best first, every node whose parent is kept and whose depth still has room. `also`
        {name: shape}: other shapes; for each whose tree is a subset of this one (so its
        acceptance is known once this tree is verified), `subsets[name]` receives its node
        indices in the returned tree. `min_score`: nodes whose chance of acceptance is not above it
        are left out (a child never outscores its parent: what is left is a tree), in every shape."""
        if st.tries is None:
            self._init_stats(st)
        budget = min(self.tree_nodes, k)
        depth = budget
        if widths is not None:
            depth = len(widths)
            budget, keep = 1 << 30, min(budget, sum(widths))   # build every node; cut below
        t = req.token_ids
        ctx = t[-max(self.pl_max, 1):].tolist()
        srcs: list[int] = []
        chain = self._chain(st, t, ctx, depth, srcs, matches=True)
        srcs = [self._tree_source(x) for x in srcs]
        win = st.window[:min(self.window, depth)]
        alts = [list(g[1:depth + 1]) for g in reversed(st.pool.get(ctx[-1])[-self.guesses:])]
        if self.pl_min == 1:
            one = self._lookup(st, t, ctx, depth, 1)[0]
            if one:
                alts.append(one)
        hits, tries = st.hits, st.tries   # rate of class c: hits[c] / tries[c]
        V = self.vocab_size
        toks: list[int] = []
        pars: list[int] = []
        cls: list[int] = []
        score: list[float] = []
        node_of: dict[tuple, int] = {}
        top: list[tuple] = []   # min-heap (score, -node) of the best `budget` nodes so far
        inserted: list[list[int]] = []

        D = self._DEPTHS
        dix = [min(j, D - 1) for j in range(depth)]   # depth index of position j (depth j+1)

        def insert(path: list[int], src: int, per_token: list[int] | None = None, tail_from: int = 1 << 30) -> None:
            """Source `src`, or `per_token` sources; tokens from tail_from on are the window
            tail (source 3). A node that cannot make the top `budget` is not added, nor is
            anything below it (a child never outscores its parent)."""
            path = path[:depth]
            if V is not None and path and not (0 <= min(path) and max(path) < V):
                path = path[:next(j for j, x in enumerate(path) if not 0 <= x < V)]
            for done in inserted:   # a prefix of an inserted path adds nothing
                if done[:len(path)] == path:
                    return
            inserted.append(path)
            par, s, fresh = -1, 1.0, True
            for j in range(len(path)):
                x = path[j]
                node = node_of.get((par, x))
                if node is None:
                    if j < tail_from:
                        c = (2 * (per_token[j] if per_token is not None else src) + (not fresh)) * D + dix[j]
                    else:
                        c = (6 + (j != tail_from)) * D + dix[j]
                    fresh = False
                    s *= hits[c] / tries[c]   # P(accepted) = P(parent accepted) * P(accepted | reached)
                    if s <= min_score or (len(top) == budget and s <= top[0][0]):
                        return    # ties lose to older nodes
                    node = node_of[(par, x)] = len(toks)
                    toks.append(x)
                    pars.append(par)
                    cls.append(c)
                    score.append(s)
                    if len(top) == budget:
                        heapq.heapreplace(top, (s, -node))
                    else:
                        heapq.heappush(top, (s, -node))
                else:
                    s = score[node]
                par = node

        lpaths = []
        if self.window_at != "chain" or not chain:
            lpaths.append(win)
        if chain and self.window_at != "root":
            lpaths.append(chain + win[len(chain):])
        if chain:
            insert(chain + (win[len(chain):] if self.window_at != "root" else []), 0, srcs, len(chain))
        if self.window_at != "chain" or not chain:
            insert(win, 4)
        for r, a in enumerate(alts, 1):
            insert(a, 4 + min(r, self.guesses + 1))
        st.lpath = lpaths
        if not top:
            return []
        # best first (ties: older first). A child scores <= its parent and is younger, so the
        # kept set holds every kept node's parent, the order is topological, and every prefix
        # of it (the scheduler may cut one) is a tree.
        order = sorted((-node for _, node in top), key=lambda i: (-score[i], i))
        tree, order = shaped_tree(order, toks, pars, widths, keep if widths is not None else 0, also, subsets,
                                  min(self.tree_nodes, k))
        st.proposed = (tree.tokens, tree.parents, [cls[i] for i in order], [score[i] for i in order])
        return tree


def shaped_tree(order: list[int], toks: list[int], pars: list[int], widths=None, keep: int = 0,
                also: "dict | None" = None, subsets: "dict | None" = None,
                cap: int | None = None) -> "tuple[DraftTree, list[int]]":
    """The draft tree of candidate nodes `order` (best first, every node after its parent) cut
    to shape `widths` (None: all of them) with at most `keep` nodes, and the candidates it kept,
    in tree order. `also` {name: shape}: for each other shape whose tree is a subset of this one
    (its acceptance is known once this tree is verified), `subsets[name]` receives its node
    indices in the returned tree. Each of those trees has at most min(`cap`, its own size) nodes
    (`cap`: the node budget before this shape's own size; default `keep`). Cutting them to
    `keep` instead made a wider shape look like a subset of a narrower one: pulling 1-1 counted
    1-1's tokens for the 3-1 tree whose leaves were never verified.

    The tree's best path (from the root, each time the best child) comes first: its rows see
    exactly a causal mask, so verification leaves them to vLLM's causal kernel and, when it is
    accepted, its KV is already where it belongs. The other nodes follow best first, so every
    prefix (the scheduler may cut one) is still a tree."""
    from vllm_spec_plugins.scorers.tree import DraftTree

    others = {}
    if widths is not None:
        kept = _select(order, pars, widths, keep)
        for name, shape in (also or {}).items():
            if len(shape) <= len(widths):
                sub = _select(order, pars, shape, min(keep if cap is None else cap, sum(shape)))
                if sub <= kept:
                    others[name] = sub
        order = [i for i in order if i in kept]
    path, up = [], -1
    for i in order:                       # best first: the first child met is the best one
        if pars[i] == up:
            path.append(i)
            up = i
    on = set(path)
    order = path + [i for i in order if i not in on]
    new = {old: j for j, old in enumerate(order)}
    if subsets is not None:
        for name, sub in others.items():
            subsets[name] = frozenset(new[i] for i in sub)
    return DraftTree([toks[i] for i in order], [new[pars[i]] if pars[i] >= 0 else -1 for i in order]), order


def _select(order: list[int], pars: list[int], widths, keep: int) -> set[int]:
    """Nodes kept by a shape: best first (`order`), a node needs its parent kept and room at its
    depth (at most widths[d] nodes at depth d+1); at most `keep` nodes."""
    kept: set[int] = set()
    room, dep = list(widths), {}
    for i in order:
        p = pars[i]
        if p >= 0 and p not in kept:
            continue
        d = dep[i] = dep[p] + 1 if p >= 0 else 0
        if d < len(room) and room[d] > 0:
            room[d] -= 1
            kept.add(i)
            if len(kept) == keep:
                break
    return kept
