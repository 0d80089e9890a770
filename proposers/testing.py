"""Test helpers: a toy greedy chain-verifying engine, `simulate`, and oracle/adversarial proposers.

`ToyEngine` builds `RequestStep`/`StepContext` the way a serving engine does: the step after a
(re)prefill reports the first token with no drafts; later steps report the verified drafts, the
accepted prefix + bonus token, and the target's argmax at every verified position. Requests
that finish, abort or are preempted are reported in the next context and drop out of the rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from vllm_spec_plugins.scorers.tree import is_chain

from .base import BuildEnv, MethodConfig, Proposer, RequestStep, StepContext, key

TargetFn = Callable[[tuple], int]


@dataclass
class _Req:
    prompt: list[int]
    max_tokens: int
    tokens: list[int]
    buf: np.ndarray
    out: list[int] = field(default_factory=list)
    drafts: list[int] | None = None   # None: needs a (re)prefill step
    accepted: list[int] = field(default_factory=list)
    steps: int = 0


class ToyEngine:
    """Greedy verification of chains and `DraftTree`s against `target_next(prefix_tuple) -> token`,
    the way the plugin's worker does.

    A tree is greedily verified in one step: row 0 = the target's token after the prefix, row
    1 + i = its token after the prefix + path(node i); the accepted path is the longest root path
    whose tokens match (first child on duplicate siblings). The next `RequestStep` then carries
    `drafts` = tree tokens, `tree_parents`, `accepted_nodes` and one `target_argmax` entry per row.
    As in the plugin: a request with `tree_ok` False gets its tree cut to the first root-to-leaf
    path (node 0, its first child, ...); a tree that is a chain (after `truncate`) is verified as
    a chain (no `tree_parents`); `truncate(req_id, num_nodes) -> m` lets a test play the scheduler
    cutting a tree to its first m nodes.
    """

    def __init__(self, proposer: Proposer, target_next: TargetFn, k: int | None = None,
                 vocab_size: int | None = None, collect_argmax: bool = True,
                 tree_ok: bool | Callable[[str], bool] = True,
                 truncate: Callable[[str, int], int] | None = None, max_tree_nodes: int | None = None):
        self.tree_ok, self.truncate, self.max_tree_nodes = tree_ok, truncate, max_tree_nodes
        self.tree_steps = 0                   # verify steps that verified a (non-chain) tree
        self.proposed_sizes: list[int] = []   # node count of every tree the proposer returned
        self.proposer, self.target_next = proposer, target_next
        self.collect_argmax = collect_argmax
        self.k = proposer.k if k is None else k
        self.vocab_size = vocab_size
        self.reqs: dict[str, _Req] = {}       # insertion order = default row order
        self.paused: dict[str, _Req] = {}
        self.done: dict[str, _Req] = {}
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self.tags: dict[str, dict | None] = {}
        self.tenants: dict[str, str | None] = {}

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int, tags: dict | None = None,
            tenant: str | None = None) -> None:
        assert prompt and max_tokens >= 1 and req_id not in self.reqs
        self.tags[req_id] = tags
        self.tenants[req_id] = tenant
        p = [int(x) for x in prompt]
        buf = np.empty(len(p) + max_tokens + 1, np.int64)
        buf[:len(p)] = p
        self.reqs[req_id] = _Req(p, max_tokens, list(p), buf)

    def abort(self, req_id: str) -> None:
        self.done[req_id] = self.reqs.pop(req_id)
        self._finished.add(req_id)

    def preempt(self, req_id: str) -> None:
        r = self.paused[req_id] = self.reqs.pop(req_id)
        r.drafts = None       # in-flight drafts are dropped; resume recomputes the KV cache
        self._preempted.add(req_id)

    def resume(self, req_id: str) -> None:
        self.reqs[req_id] = self.paused.pop(req_id)

    def step(self, order: Iterable[str] | None = None) -> list:
        rows: list[RequestStep] = []
        order = list(self.reqs) if order is None else list(order)
        assert sorted(order) == sorted(self.reqs), "order must list every running request once"
        for rid in order:
            r = self.reqs[rid]
            prefix = tuple(r.tokens)
            d = r.drafts
            parents = accepted_nodes = None
            if isinstance(d, tuple):                       # (tokens, parents): a tree
                drafts, parents = list(d[0]), list(d[1])
                paths: list[tuple] = []
                for tok, p in zip(drafts, parents):
                    paths.append((paths[p] if p >= 0 else ()) + (tok,))
                argmax = [self.target_next(prefix)] + [self.target_next(prefix + pt) for pt in paths]
                children: list[list[int]] = [[] for _ in range(len(drafts) + 1)]
                for i, p in enumerate(parents):
                    children[p + 1].append(i)
                row, accepted_nodes = 0, []
                while True:
                    nxt = next((c for c in children[row] if drafts[c] == argmax[row]), None)
                    if nxt is None:
                        break
                    accepted_nodes.append(nxt)
                    row = nxt + 1
                sampled = [drafts[i] for i in accepted_nodes] + [argmax[row]]
                a = len(accepted_nodes)
                self.tree_steps += 1
            else:
                drafts = d or []
                argmax = [self.target_next(prefix + tuple(drafts[:i])) for i in range(len(drafts) + 1)]
                a = 0
                while a < len(drafts) and drafts[a] == argmax[a]:
                    a += 1
                sampled = drafts[:a] + [argmax[a]]
            if r.drafts is not None:
                r.accepted.append(a)
            r.steps += 1
            sampled = sampled[:r.max_tokens - len(r.out)]
            r.tokens += sampled
            r.out += sampled
            if len(r.out) >= r.max_tokens:
                self.done[rid] = self.reqs.pop(rid)
                self._finished.add(rid)
                continue
            n = len(r.tokens)
            r.buf[n - len(sampled):n] = sampled
            view = r.buf[:n]
            view.flags.writeable = False
            rows.append(RequestStep(rid, view, sampled, list(drafts), argmax if self.collect_argmax else None,
                                    parents, accepted_nodes, self._tree_ok(rid), self.tags.get(rid), greedy=True,
                                    tenant=self.tenants.get(rid)))
        ctx = StepContext(rows, self._finished, self._preempted, self.k)
        self._finished, self._preempted = set(), set()
        out = self.proposer.propose(ctx)
        assert len(out) == len(rows)
        for row, d in zip(rows, out):
            if hasattr(d, "parents"):                      # a DraftTree
                toks, par = [int(x) for x in d.tokens], [int(p) for p in d.parents]
                assert len(toks) == len(par) and all(-1 <= p < i for i, p in enumerate(par)), (toks, par)
                self.proposed_sizes.append(len(toks))
                assert len(toks) <= self.k, f"{len(toks)} tree nodes > k={self.k}"
                if self.max_tree_nodes is not None:
                    assert len(toks) <= self.max_tree_nodes, f"{len(toks)} > {self.max_tree_nodes} nodes"
                if not row.tree_ok:                        # the plugin cuts it to its first path
                    chain, cur = [], -1
                    while (nxt := next((i for i, p in enumerate(par) if p == cur), None)) is not None:
                        chain.append(toks[nxt])
                        cur = nxt
                    toks, par = chain, list(range(-1, len(chain) - 1))
                elif self.truncate is not None:
                    m = max(0, int(self.truncate(row.req_id, len(toks))))
                    toks, par = toks[:m], par[:m]
                stored = list(toks) if is_chain(par) else (toks, par)
            else:
                toks = [int(x) for x in d]
                assert len(toks) <= self.k, f"{len(toks)} drafts > k={self.k}"
                stored = toks
            if self.vocab_size is not None:
                assert all(0 <= x < self.vocab_size for x in toks), toks
            self.reqs[row.req_id].drafts = stored
        return out

    def _tree_ok(self, rid: str) -> bool:
        return self.tree_ok(rid) if callable(self.tree_ok) else bool(self.tree_ok)

    def flush(self) -> None:
        """Report pending finished/preempted ids to the proposer (a step with no rows)."""
        if self._finished or self._preempted:
            self.proposer.propose(StepContext([], self._finished, self._preempted, self.k))
            self._finished, self._preempted = set(), set()


def simulate(proposer: Proposer, target_next: TargetFn, prompt: list[int], max_tokens: int, *,
             k: int | None = None, vocab_size: int | None = None,
             req_id: str = "sim") -> tuple[list[int], int, list[int]]:
    """Greedy speculative decoding of one request. Returns (output tokens, target steps
    including the prefill step, accepted drafts per verify step). tau = len(out) / steps."""
    eng = ToyEngine(proposer, target_next, k, vocab_size)
    eng.add(req_id, prompt, max_tokens)
    while eng.reqs:
        eng.step()
    eng.flush()
    r = eng.done[req_id]
    return r.out, r.steps, r.accepted


def greedy(target_next: TargetFn, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding (the reference output)."""
    t = tuple(int(x) for x in prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(target_next(t))
        t += (out[-1],)
    return out


class _RefState:
    __slots__ = ("ref", "plen")

    def __init__(self):
        self.ref: list[int] | None = None
        self.plen = 0


class OracleProposer(Proposer):
    """Drafts the true next k tokens from reference greedy outputs (100% acceptance).

    `references` maps a req_id (str) or a prompt (tuple of token ids) to the reference output.
    Prompt keys are matched as a prefix of the request's tokens (longest prompt wins), so an
    engine test can key by prompt without knowing request ids.
    """

    def __init__(self, k: int, references: dict | None = None):
        super().__init__(k)
        self.by_id: dict[str, list[int]] = {}
        self.by_prompt: dict[tuple, list[int]] = {}
        for prompt, out in (references or {}).items():
            self.add_reference(prompt, out)

    def add_reference(self, key: str | Sequence[int], output: Sequence[int]) -> None:
        out = [int(x) for x in output]
        if isinstance(key, str):
            self.by_id[key] = out
        else:
            self.by_prompt[tuple(int(x) for x in key)] = out

    def new_state(self, req: RequestStep) -> _RefState:
        return _RefState()

    def _resolve(self, st: _RefState, req: RequestStep) -> None:
        t = req.token_ids
        L = len(t)
        # On the step after the prefill (no drafts) the prompt length is L0; after a resume it
        # is unknown, so the longest matching prompt / longest output overlap wins.
        L0 = L - len(req.sampled) if not req.drafts else -1
        best = None
        for p, out in self.by_prompt.items():
            if len(p) < L and tuple(t[:len(p)].tolist()) == p:
                if best is None or len(p) == L0 or (len(best[0]) != L0 and len(p) > len(best[0])):
                    best = (p, out)
        if best is not None:
            st.ref, st.plen = best[1], len(best[0])
            return
        ref = self.by_id.get(req.req_id)
        if ref is None:
            return
        cands = [L0] if L0 >= 0 else []
        cands += range(max(L - len(ref), 0), L)
        for plen in cands:
            if t[plen:].tolist() == ref[:L - plen]:
                st.ref, st.plen = ref, plen
                return

    def observe(self, st: _RefState, req: RequestStep) -> None:
        if st.ref is None:
            self._resolve(st, req)

    def _next(self, st: _RefState, req: RequestStep, k: int) -> list[int]:
        if st.ref is None:
            return []
        pos = len(req.token_ids) - st.plen
        return st.ref[pos:pos + k]

    def propose_one(self, st: _RefState, req: RequestStep, k: int) -> list[int]:
        return self._next(st, req, k)


class AdversarialProposer(OracleProposer):
    """Drafts tokens that are wrong at every position (0% acceptance): reference token + 1 mod
    vocab. Without a reference (or past its end) it drafts `fallback` (default vocab_size - 1),
    which is only wrong if the target never emits it."""

    def __init__(self, k: int, references: dict | None = None, vocab_size: int = 2,
                 fallback: int | None = None):
        if vocab_size < 2:
            raise ValueError(f"AdversarialProposer: vocab_size must be >= 2, got {vocab_size}")
        super().__init__(k, references)
        self.vocab_size = vocab_size
        self.fallback = vocab_size - 1 if fallback is None else fallback

    def propose_one(self, st: _RefState, req: RequestStep, k: int) -> list[int]:
        true = self._next(st, req, k)
        return [(x + 1) % self.vocab_size for x in true] + [self.fallback] * (k - len(true))


class AlternatingStepTimer(Proposer):
    """Bench helper: drafts with each of `kinds` in turn, one step each (the whole batch alike),
    and records the wall time of every step by the kind it verified (time from one proposal to
    the next) in `stats[f"{kind}_step_s"]`. All kinds run in one engine under the same machine
    conditions, interleaved step by step. A kind may be None: no drafts (a plain decode step).
    A step is filed only if the batch is the one that got the proposal, every row decoding (no
    prefill chunk) and, for a drafting kind, every row verifying drafts."""

    def __init__(self, kinds: "dict[str, Proposer | None]", clock=None):
        import time
        super().__init__(max(p.k for p in kinds.values() if p is not None))
        self.clock = clock or time.perf_counter
        self.kinds = kinds
        self.order = list(kinds)
        self.stats = {f"{name}_step_s": [] for name in self.order}
        self._last: tuple[float, str, list] | None = None   # (time of the last proposal, kind, req ids)
        self._i = 0

    @property
    def _next(self) -> str:
        return self.order[self._i % len(self.order)]

    def release(self, req_id: str) -> None:
        for p in self.kinds.values():
            if p is not None:
                p.release(req_id)

    def propose(self, ctx: StepContext) -> list:
        now = self.clock()
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:     # every kind's state, not just the next one's
            self.release(rid)
        if self._last is not None:
            t, kind, ids = self._last
            if [r.req_id for r in ctx.requests] == ids and all(r.sampled for r in ctx.requests) \
                    and (self.kinds[kind] is None or all(r.drafts for r in ctx.requests)):
                self.stats[f"{kind}_step_s"].append(now - t)
        kind = self._next
        self._i += 1
        prop = self.kinds[kind]
        out = [[] for _ in ctx.requests] if prop is None else prop.propose(ctx)
        drafted = prop is None or all(len(d) for d in out)
        self._last = (self.clock(), kind, [r.req_id for r in ctx.requests]) if drafted else None
        return out


class HiddenStateProbe(Proposer):
    """Wraps a test proposer and checks every `RequestStep.hidden_states` it is handed: one row per
    verified position, and the output head over row i must rank the target's argmax there first
    (up to a float tie of 1e-4 relative). Counts in `stats`; drafting is the wrapped proposer's."""

    needs_target_argmax = True
    needs_hidden_states = True

    def __init__(self, inner: Proposer, head):
        super().__init__(inner.k)
        self.inner, self.head = inner, head.float()
        self.states = inner.states
        self.stats = {"hidden_rows": 0, "hidden_mismatch": 0, "hidden_missing": 0}

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)

    def propose(self, ctx: StepContext) -> list:
        import torch
        for req in ctx.requests:
            if not req.target_argmax:
                continue
            h = req.hidden_states
            if h is None or h.shape[0] != len(req.target_argmax):
                self.stats["hidden_missing"] += 1
                continue
            logits = h.float() @ self.head.T
            top = logits.max(-1).values
            at = logits.gather(1, torch.tensor(req.target_argmax)[:, None])[:, 0]
            self.stats["hidden_rows"] += h.shape[0]
            self.stats["hidden_mismatch"] += int((top - at > 1e-4 * top.abs().clamp(min=1.0)).sum())
        return self.inner.propose(ctx)


def load_references(path: str) -> dict[tuple, list[int]]:
    """Reference file for the engine's test methods: JSON [[prompt_ids, output_ids], ...]."""
    import json
    with open(path) as f:
        return {tuple(p): list(o) for p, o in json.load(f)}


class OracleTreeProposer(OracleProposer):
    """A random draft tree of `nodes` nodes that hides the true continuation (`depth` tokens)
    in one branch; every other node is a wrong token. With exact tree verification every step
    accepts the whole true branch: tau = depth + 1. `adversarial=True`: no true branch at all."""

    def __init__(self, k: int, references: dict | None = None, nodes: int = 8, depth: int = 3,
                 vocab_size: int = 2, adversarial: bool = False, seed: int = 0):
        if not 1 <= depth <= nodes <= k:
            raise ValueError(f"need 1 <= depth ({depth}) <= nodes ({nodes}) <= k ({k})")
        super().__init__(k, references)
        self.nodes, self.depth, self.vocab = nodes, depth, vocab_size
        self.adversarial, self.seed = adversarial, seed

    def propose_one(self, st, req, k):
        from vllm_spec_plugins.scorers import DraftTree
        true = self._next(st, req, min(self.depth, k))
        rng = np.random.default_rng([self.seed, len(req.token_ids)])
        if not true and self.adversarial and not self.by_prompt and not self.by_id:
            true = [0] * min(self.depth, k)        # no references: every node drafts vocab-1
        if not true:
            return []
        nodes = min(self.nodes, k)
        # Build: the true path goes in as a random sibling position; distractors get random
        # parents among nodes already placed; tokens never equal a true child of that parent.
        tokens, parents = [], []
        true_node = {}                            # depth -> node index on the true path
        n_true = len(true)
        order = sorted(rng.choice(nodes, size=n_true, replace=False).tolist())
        for i in range(nodes):
            if order and i == order[0] and len(true_node) < n_true:
                order.pop(0)
                d = len(true_node) + 1
                tokens.append(true[d - 1] if not self.adversarial else (true[d - 1] + 1) % self.vocab)
                parents.append(true_node.get(d - 1, -1))
                true_node[d] = i
                continue
            p = int(rng.integers(-1, i)) if i else -1
            # a true-path parent at depth d has true child true[d]; never duplicate it
            d_parent = next((d for d, n in true_node.items() if n == p), 0 if p == -1 else None)
            bad = {true[d_parent]} if d_parent is not None and d_parent < n_true else set()
            t = int(rng.integers(0, self.vocab))
            while t in bad:
                t = (t + 1) % self.vocab
            tokens.append(t)
            parents.append(p)
        return DraftTree(tokens, parents)


# ---------------------------------------------------------------------------------------------
# Draft trees: a tree-verifying toy engine (chains go through `ToyEngine`'s chain path unchanged)
# ---------------------------------------------------------------------------------------------


TreeToyEngine = ToyEngine   # the name the tree tests use


def simulate_tree(proposer: Proposer, target_next: TargetFn, prompt: list[int], max_tokens: int, *,
                  k: int | None = None, vocab_size: int | None = None, req_id: str = "sim",
                  tree_ok: bool = True, max_tree_nodes: int | None = None,
                  step_times: list[float] | None = None) -> tuple[list[int], int, list[int]]:
    """`simulate` on a `TreeToyEngine` (the proposer may return trees). `step_times`, when
    given, receives the proposer's wall time of every step (seconds)."""
    import time

    eng = TreeToyEngine(proposer, target_next, k, vocab_size, tree_ok=tree_ok, max_tree_nodes=max_tree_nodes)
    if step_times is not None:
        inner = proposer.propose

        def timed(ctx):
            t0 = time.perf_counter()
            out = inner(ctx)
            step_times.append(time.perf_counter() - t0)
            return out

        proposer.propose = timed
    try:
        eng.add(req_id, prompt, max_tokens)
        while eng.reqs:
            eng.step()
        eng.flush()
    finally:
        if step_times is not None:
            del proposer.propose
    r = eng.done[req_id]
    return r.out, r.steps, r.accepted


def pair_table_target(vocab_size: int = 50, seed: int = 0, noise: float = 0.1, skew: float = 0.0,
                      branching: int | None = None) -> TargetFn:
    """A 'noisy' toy target: next = T[t[-2], t[-1]] for a random table T (so the last token alone
    does not determine the next one: the pool must learn which of its candidates applies), except
    for a pseudo-random `noise` fraction of (position, last two tokens), where the next token is
    a hash of those (deterministic; unpredictable unless the last two tokens are right). `skew`:
    that fraction of pairs (a, b) map to g[b] instead (a mostly-last-token target). `branching`:
    T[a, b] = G[b, a % branching], the last token leaves that many options (a tree's breadth can
    cover them, a chain cannot). Without
    the noise the text falls into a short cycle (a random map on vocab^2 pairs) that prompt
    lookup alone handles."""
    rng = np.random.default_rng(seed)
    T = rng.integers(0, vocab_size, (vocab_size, vocab_size))
    if skew:   # a `skew` fraction of pairs (a, b) follow g[b]: mostly a function of the last token
        T = np.where(rng.random(T.shape) < skew, rng.integers(0, vocab_size, vocab_size)[None, :], T)
    if branching:  # T[a, b] = G[b, a % branching]: the last token leaves `branching` options
        G = rng.integers(0, vocab_size, (vocab_size, branching))
        T = G[np.arange(vocab_size)[None, :], np.arange(vocab_size)[:, None] % branching]
    T = T.tolist()
    thresh = int(noise * 2 ** 32)

    def f(t: tuple) -> int:
        h = (len(t) * 0x9E3779B1 + seed * 0x85EBCA77 + t[-1] * 0x27D4EB2F + t[-2] * 0x165667B1) & 0xFFFFFFFF
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        if h < thresh:
            return (h >> 7) % vocab_size
        return T[t[-2]][t[-1]]

    return f


# ---- test-only methods, served when the tests register them (`register`) ------------------------
_REFS_HELP = "JSON file: [[prompt_ids, output_ids], ...]"


@dataclass
class OracleConfig(MethodConfig):
    """Drafts from a reference file {prompt ids -> plain greedy output ids}."""
    method = "oracle"
    num_speculative_tokens: int = key(4, 1, 64, "draft chain length / tree node budget")
    references: str = key(None, help=_REFS_HELP)
    tree_nodes: int = key(0, 0, 64, "0: chain drafts; else a random tree of this many nodes")
    tree_depth: int = key(3, 1, 64, "depth of the true branch hidden in the tree")
    check_hidden_states: bool = key(False, help="check the target hidden states handed to the proposer")

    def check(self) -> None:
        if self.tree_nodes and not self.tree_depth <= self.tree_nodes <= self.num_speculative_tokens:
            raise ValueError("speculative_config: need tree_depth <= tree_nodes <= num_speculative_tokens")
        if self.references and not os.access(self.references, os.R_OK):
            raise ValueError(f"speculative_config.references={self.references!r} does not exist or is not readable")

    @property
    def needs_target(self) -> bool:
        return self.check_hidden_states

    @property
    def uses_trees(self) -> bool:
        return bool(self.tree_nodes)

    def build(self, env: BuildEnv) -> Proposer:
        k, vocab = self.num_speculative_tokens, env.vocab_size
        refs = load_references(self.references) if self.references else {}
        adversarial = self.method == "adversarial"
        if getattr(self, "cycle", None):
            return AlternatingStepTimer({str(n): AdversarialProposer(n, refs, vocab_size=vocab) if n else None
                                         for n in self.cycle})
        if getattr(self, "alternate", False):
            return AlternatingStepTimer({
                "chain": AdversarialProposer(k, references=refs, vocab_size=vocab),
                "tree": OracleTreeProposer(k, refs, self.tree_nodes, self.tree_depth, vocab or 2, adversarial=True)})
        if self.tree_nodes:
            prop = OracleTreeProposer(k, refs, self.tree_nodes, self.tree_depth, vocab or 2, adversarial=adversarial)
        elif adversarial:
            prop = AdversarialProposer(k, references=refs, vocab_size=vocab)
        else:
            prop = OracleProposer(k, references=refs)
        if self.check_hidden_states:
            from .mamba import target_embeddings
            prop = HiddenStateProbe(prop, target_embeddings(env.target)[1])
        return prop


@dataclass
class AdversarialConfig(OracleConfig):
    """Drafts wrong tokens on purpose (or a reference's, then wrong ones)."""
    method = "adversarial"
    references: str = key("", help=_REFS_HELP + "; empty: draft token vocab-1 (wrong unless the target emits it)")
    alternate: bool = key(False, help="bench: alternate a chain of num_speculative_tokens and a tree of tree_nodes "
                          "every step, timing each kind of verification step")
    cycle: list = key([], help="bench: chain lengths (0 = no drafts) drafted in turn, one per step, timing the "
                      "steps that verify each")

    def check(self) -> None:
        super().check()
        c, k = self.cycle, self.num_speculative_tokens
        if c and not (len(c) >= 2 and len(set(c)) == len(c) and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= k for x in c)):
            raise ValueError(f"speculative_config.cycle={c!r}: give >= 2 distinct chain lengths, "
                             f"each 0..num_speculative_tokens={k}")
        if self.alternate and not self.tree_nodes:
            raise ValueError("speculative_config.alternate needs tree_nodes (the tree it alternates with the chain)")


#: set in the environment of every vLLM process that should serve the test-only methods (the
#: tests' conftest, the benchmark's `--draft-cost`); the plugin's `register()` reads it
TEST_METHODS_ENV = "VLLM_SPEC_PLUGINS_TEST_METHODS"


def register() -> None:
    """Adds `oracle` and `adversarial` to the served methods (tests and timing tools only)."""
    from vllm_spec_plugins.proposers import register_method
    register_method("oracle", f"{__name__}:OracleConfig")
    register_method("adversarial", f"{__name__}:AdversarialConfig")
