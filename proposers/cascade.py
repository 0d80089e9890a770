"""Vertical cascade: a model-free level drafts for the Mamba drafter, which drafts for the target.

Per step and request (all rows batched):
  level 0  model-free, ~free: a chain c of up to k tokens, from a `LookaheadProposer`'s chain form
           without its window (levels ['lookahead', 'mamba'], the default): the request's text,
           its pool of n-grams harvested from the target's own outputs at every verified
           position (the Jacobi trajectory of whatever was drafted) and the n-gram table shared
           by all requests; or from n-gram lookup over the request's own tokens (prompt +
           output; ['ngram', 'mamba'], `level0=None`).
  level 1  the Mamba drafter runs over [bonus, c1..cm] (one C step per position, all rows at
           once; without the C kernel one torch pass, `StateSpaceDrafter.steps`), states kept
           per position, and keeps the longest prefix c1..ca equal to its own greedy choices,
           plus its own next token (free); then up to `drafter_steps` recurrent steps extend
           the chain (no more than the step's budget of k drafts can use).
With `drafter_top_k=1` the target sees exactly the drafter's own greedy chain (a level-0 token is
kept only where the drafter would have drafted it). With `drafter_top_k=K` the drafter keeps a
level-0 token it ranks in its top K: level 0 wins near-ties against the drafter's own
guess; with `drafter_top_k=0` every level-0 token is kept (the target judges them; the drafter
only extends the chain past them).

Under `Goodput` (the default), while the drafter does not pay for its own time (a batch where a
verified token is dear), level 0 drafts for the target alone (`propose_fallback`), its tokens in
classes of their own; the drafter catches up on the tokens it skipped when it drafts again.

Snapshots as in `MambaProposer`: snapshot j = drafter state after the request's tokens and its first
j drafts, for every draft handed out, so a rejection resumes with no recomputation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_spec_plugins.proposers.base import (
    GOODPUT_HELP,
    NGRAM_ALONE,
    NGRAM_ALONE_PRIOR,
    BuildEnv,
    MethodConfig,
    Proposer,
    StepContext,
    check_prompt_lookup,
    key,
    ngram_alone,
    ngram_lookup,
)
from vllm_spec_plugins.proposers.lookahead import SHARED_POOL_HELP, LookaheadConfig, LookaheadProposer
from vllm_spec_plugins.proposers.mamba import (
    CONF_PRIOR,
    DRAFTER_HELP,
    MambaProposer,
    StateSpaceDrafter,
    confidence_classes,
)

#: the cascades this release runs, the default first
LEVELS = (["lookahead", "mamba"], ["ngram", "mamba"])


@dataclass
class CascadeConfig(MethodConfig):
    method = "cascade"
    num_speculative_tokens: int = key(8, 1, 16, "max drafts handed to the target per step")
    #: level 0 = lookahead's chain form: against n-gram lookup, served beside plain and vLLM's ngram
    #: and suffix on fresh prompts, cold, bf16 (docs/benchmarks.md, family 25): batch 1 1.37x /
    #: 1.85x / 2.33x plain against 1.32x / 1.59x / 2.21x (chat / code / repetitive), batch 8
    #: 1.05x / 1.14x / 1.15x against 1.01x / 1.10x / 1.16x
    levels: list = key(LEVELS[0], help="draft levels, cheapest first; each drafts for the next, the "
                       "last for the target: ['lookahead', 'mamba'] (level 0: lookahead's chain form: its text "
                       "index, its pool of n-grams from the target's own outputs, the shared pool) or "
                       "['ngram', 'mamba'] (level 0: n-gram lookup in the request's own tokens)")
    model: str = key(None, help="the 'mamba' level's drafter: " + DRAFTER_HELP)
    drafter_steps: int = key(3, 0, 16, "sequential drafter steps after its one-pass check of level 0's chain")
    drafter_top_k: int = key(0, 0, 64, "the drafter keeps a level-0 token it ranks in its top k (1: only its own "
                             "greedy choice; 0: all)")
    prompt_lookup_min: int = key(NGRAM_ALONE[0], 1, 16, "level 0: prompt lookup's min match length")
    prompt_lookup_max: int = key(NGRAM_ALONE[1], 1, 16, "level 0: prompt lookup's max match length")
    shared_pool: int = key(65536, 0, 1 << 22, "'lookahead' level: " + SHARED_POOL_HELP)
    goodput: bool = key(True, help=GOODPUT_HELP)

    def check(self) -> None:
        check_prompt_lookup(self)
        if self.levels not in LEVELS:
            raise ValueError(f"speculative_config.levels={self.levels!r}: this release runs the cascades "
                             "['lookahead', 'mamba'] and ['ngram', 'mamba'] (a model-free level drafts for "
                             "the Mamba drafter, which drafts for the target)")

    def drafter_folder(self) -> str | None:
        return self.model

    def level0(self) -> LookaheadConfig | None:
        """The 'lookahead' level's chain form (None: n-gram lookup in the request's own tokens)."""
        if self.levels[0] != "lookahead":
            return None
        k = self.num_speculative_tokens
        return LookaheadConfig(num_speculative_tokens=k, ngram=min(4, k + 1), shared_pool=self.shared_pool,
                               prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                               goodput=False)

    def build(self, env: BuildEnv) -> Proposer:
        prop = CascadeProposer(self, env.load_drafter(self.model), env.max_requests, vocab_size=env.vocab_size)
        if self.goodput:
            from .goodput import Goodput
            return Goodput(prop)
        return prop


class CascadeProposer(Proposer):
    # Token classes for `Goodput`: the drafter's own tokens by its confidence (as `mamba`), then
    # level-0 tokens by the probability the drafter gives them in its one-pass check; from
    # `ALONE` on, level 0's tokens drafted for the target alone (`propose_fallback`).
    class_prior = np.concatenate([np.repeat(CONF_PRIOR, 4), np.repeat([0.5 * (0.4 + c) for c in CONF_PRIOR], 4)])
    ALONE = len(class_prior)

    def __init__(self, cfg: CascadeConfig, drafter: StateSpaceDrafter, max_requests: int = 8,
                 vocab_size: int | None = None, level0: LookaheadProposer | None = None):
        """`level0`: a lookahead level to use instead of the one `cfg.levels` describes."""
        super().__init__(cfg.num_speculative_tokens)
        self.cfg = cfg
        self.drafter_steps = cfg.drafter_steps
        #: the drafter's slots; the C step writes every drafter step's state to a snapshot (a0 +
        #: step, up to k + drafter_steps + 1): those past k are scratch, never read
        self.mamba = MambaProposer(self.k, drafter, max_requests, scratch_snapshots=self.drafter_steps + 1)
        self.states = self.mamba.slots
        self.d, self.kernel = self.mamba.d, self.mamba.kernel
        self.ngram_min, self.ngram_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.top_k = cfg.drafter_top_k
        if level0 is None and cfg.level0() is not None:
            level0 = LookaheadProposer(cfg.level0(), vocab_size=vocab_size)
        self.level0 = level0
        if self.level0 is not None:              # its pool learns from the target's argmax rows
            self.needs_target_argmax = True
        alone = np.ravel(NGRAM_ALONE_PRIOR) if level0 is None else level0.class_prior
        self.class_prior = np.concatenate([CascadeProposer.class_prior, alone])
        self._level0_once = 0.0                  # the lookahead level's one-off seconds (prompt indexing)
        inv = torch.full((int(drafter.draft_vocab.max()) + 1,), -1, dtype=torch.long)
        inv[drafter.draft_vocab] = torch.arange(len(drafter.draft_vocab))
        self.draft_index = inv                   # target id -> draft-vocab index (-1: not in it)
        self.origin: dict[str, int] = {}         # req_id -> drafts of last step that came from level 0
        # per-level accounting (bench / plugin_state_summary): tokens proposed by level 0, kept by
        # the drafter, handed to the target per level and accepted by it per level; seconds per level
        self.stats = {"level0_proposed": 0, "level0_kept": 0, "drafter_tokens": 0,
                      "target_drafts_level0": 0, "target_drafts_drafter": 0,
                      "target_accepted_level0": 0, "target_accepted_drafter": 0,
                      "level0_s": 0.0, "drafter_s": 0.0, "steps": 0}

    # one clock and one count of one-off seconds for both levels (`Goodput` reads and sets them)
    @property
    def clock(self):
        return self.mamba.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.mamba.clock = clock
        if self.level0 is not None:
            self.level0.clock = clock

    @property
    def once_seconds(self) -> float:
        return self.mamba.once_seconds + self._level0_once

    def release(self, req_id: str) -> None:
        self.mamba.release(req_id)
        self.origin.pop(req_id, None)
        if self.level0 is not None:
            self.level0.release(req_id)

    def request_ids(self) -> set[str]:
        return set(self.mamba.slots) | (self.level0.request_ids() if self.level0 is not None else set())

    def state_nbytes(self, req_id: str) -> int:
        n = self.mamba.state_nbytes(req_id) if req_id in self.mamba.slots else 0
        return n + (self.level0.state_nbytes(req_id) if self.level0 is not None else 0)

    def summary(self) -> dict:
        return self.level0.summary() if self.level0 is not None else {}

    def _level0(self, req, k: int) -> list[int]:
        """Level 0's chain, for the drafter to check."""
        if self.level0 is None:
            return ngram_lookup(req.token_ids, k, self.ngram_min, self.ngram_max)
        return self.level0.chain(self._lookahead_state(req), req.token_ids, k)

    def _level0_alone(self, req, k: int) -> tuple[list[int], list[int]]:
        """Level 0's chain for the target alone, and its classes (from `ALONE` on)."""
        if self.level0 is None:
            return ngram_alone(req.token_ids, k, self.ngram_min, self.ngram_max, self.ALONE)
        chain, cls = self.level0.classed_chain(self._lookahead_state(req), req.token_ids, k)
        return chain, [self.ALONE + c for c in cls]

    def _lookahead_state(self, req):
        """The lookahead level's state of `req`, after last step's verified drafts."""
        la = self.level0
        st = la.states.get(req.req_id)
        if st is None:
            st = la.states[req.req_id] = la.new_state(req)
        once0 = la.once_seconds
        la.observe(st, req)                      # last step's verified drafts -> its pools
        self._level0_once += la.once_seconds - once0     # a new request's prompt indexing: one-off
        return st

    def _own_accepted(self, req) -> int:
        """Last step's accepted drafts that the drafter's snapshots hold (none when level 0
        drafted alone), after crediting them to their level."""
        a, rid = req.num_accepted, req.req_id
        if rid in self.origin:                           # attribute last step's acceptance
            o = self.origin.pop(rid)
            self.stats["target_accepted_level0"] += min(a, o)
            self.stats["target_accepted_drafter"] += max(a - o, 0)
        return self.mamba.own_accepted(req, a)

    def propose_fallback(self, ctx: StepContext) -> list:
        """Level 0's chains for the target, the drafter skipped: what `Goodput` drafts while the
        drafter does not pay (at a batch size where a verified token is dear, on a CPU). The
        drafter catches up on the tokens it skipped when it drafts again."""
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        k = ctx.budget(self.k)
        out: list[list[int]] = [[] for _ in ctx.requests]
        self.classes = [[] for _ in ctx.requests]
        t0 = time.perf_counter()
        for i, req in enumerate(ctx.requests):
            if not req.sampled:
                continue
            self.mamba.skip(req, self._own_accepted(req))
            if k:
                out[i], self.classes[i] = self._level0_alone(req, k)
                if out[i]:
                    self.mamba.alone.add(req.req_id)
                    self.origin[req.req_id] = len(out[i])
                    self.stats["level0_proposed"] += len(out[i])
                    self.stats["target_drafts_level0"] += len(out[i])
        self.stats["level0_s"] += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def propose(self, ctx: StepContext) -> list:
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        k = ctx.budget(self.k)
        mp = self.mamba
        out: list[list[int]] = [[] for _ in ctx.requests]
        self.classes = [[] for _ in ctx.requests]
        t0 = time.perf_counter()
        rows, slots, snap, feed = [], [], [], []
        for i, req in enumerate(ctx.requests):
            if not req.sampled:
                continue
            a, rid = self._own_accepted(req), req.req_id
            if k == 0:
                mp.skip(req, a)
                continue
            snap.append(mp.before_last(req, a))
            mp.ntok[rid] = len(req.token_ids)
            lvl0 = self._level0(req, k)
            rows.append(i), slots.append(mp.slots[rid])
            feed.append([int(req.token_ids[-1])] + lvl0)
        if not rows:
            return out
        T = max(len(f) for f in feed)
        m = torch.tensor([len(f) - 1 for f in feed])             # level-0 tokens per row
        x = torch.tensor([f + [0] * (T - len(f)) for f in feed])  # [b, T]
        t1 = time.perf_counter()
        sl, sn = torch.tensor(slots), torch.tensor(snap)
        layers, kernel = mp.buf, self.kernel
        if kernel is not None:
            # T C steps, bonus then level 0: snapshot p = after bonus + p level-0 tokens. Past a
            # row's a0 they are scratch: the steps below rewrite them before anything reads them.
            hs = [self.d.step_into(x[:, p], layers, sl, sn if p == 0 else torch.full_like(sl, p - 1),
                                   torch.full_like(sl, p), kernel) for p in range(T)]
            h, sts = torch.stack(hs, 1), None
        else:
            st = [(c[sl, sn], s[sl, sn]) for c, s in layers]
            h, sts = self.d.steps(x, st)                         # one pass over bonus + level 0
        lg = self.d.logits(h)
        prob = torch.softmax(lg, -1)
        conf, g = prob.max(-1)
        g = self.d.draft_vocab[g]                                # [b, T]: drafter's choice after each
        di = self.draft_index[x[:, 1:].clamp(max=len(self.draft_index) - 1)]   # level-0 tokens' draft ids
        p0 = prob[:, :-1].gather(-1, di.clamp(min=0)[..., None])[..., 0] * (di >= 0)
        j = torch.arange(T - 1)
        if self.top_k == 0:     # keep every level-0 token: the target verifies them directly
            agree = torch.ones(len(rows), T - 1, dtype=torch.bool)
        elif self.top_k > 1:    # keep a level-0 token the drafter ranks in its top k
            top = self.d.draft_vocab[lg[:, :-1].topk(self.top_k, -1).indices]   # [b, T-1, top_k]
            agree = (top == x[:, 1:, None]).any(-1)
        else:
            agree = x[:, 1:] == g[:, :-1]
        agree &= j[None] < m[:, None]
        a0 = agree.int().cumprod(1).sum(1) if T > 1 else torch.zeros(len(rows), dtype=torch.long)
        r = torch.arange(len(rows))
        # snapshots 0..a0 come straight from the pass (snapshot j = after bonus + j drafts)
        if sts is not None:
            for p in range(min(T, k + 1)):
                keep = (p <= a0)
                for (cb, sb), (c, s) in zip(layers, sts):
                    cb[sl, p] = torch.where(keep[:, None, None], c[:, p], cb[sl, p])
                    sb[sl, p] = torch.where(keep[:, None, None, None], s[:, p], sb[sl, p])
            st = [(c[r, a0], s[r, a0]) for c, s in sts]           # state after bonus + a0 drafts
        tok = g[r, a0]                                            # the drafter's own next token
        drafts, confs = [tok], [conf[r, a0]]
        # sequential steps: no more than the budget can use (k drafts, a0 + 1 of them already
        # there; goodput may ask for fewer than num_speculative_tokens)
        n_steps = min(self.drafter_steps, max(k - 1 - int(a0.min()), 0))
        for step in range(1, n_steps + 2):                       # feed each new draft; last: snapshot only
            idx = a0 + step                                       # snapshot index after that draft
            if kernel is not None:                                # snapshot idx - 1 -> idx, in place
                hh = self.d.step_into(tok, layers, sl, idx - 1, idx, kernel, hidden=step <= n_steps)
            else:
                hh, st = self.d.step(tok, st)
                keep = idx <= k
                ic = idx.clamp(max=k)
                for (cb, sb), (c, s) in zip(layers, st):
                    cb[sl, ic] = torch.where(keep[:, None, None], c, cb[sl, ic])
                    sb[sl, ic] = torch.where(keep[:, None, None, None], s, sb[sl, ic])
            if step == n_steps + 1:
                break
            c1, tok = torch.softmax(self.d.logits(hh), -1).max(-1)
            tok = self.d.draft_vocab[tok]
            drafts.append(tok), confs.append(c1)
        tail = torch.stack(drafts, 1).tolist()                   # host sync (and a0.min() above)
        tail_cls = confidence_classes(torch.stack(confs, 1), a0).tolist()
        lvl0_cls = (32 + confidence_classes(p0) if T > 1 else torch.zeros(len(rows), 0, dtype=torch.long)).tolist()
        a0 = a0.tolist()
        t2 = time.perf_counter()
        for b, i in enumerate(rows):
            chain = (feed[b][1:1 + a0[b]] + tail[b])[:k]
            out[i] = chain
            self.classes[i] = (lvl0_cls[b][:a0[b]] + tail_cls[b])[:k]
            rid = ctx.requests[i].req_id
            self.origin[rid] = min(a0[b], len(chain))
            s = self.stats
            s["level0_proposed"] += len(feed[b]) - 1
            s["level0_kept"] += a0[b]
            s["target_drafts_level0"] += min(a0[b], len(chain))
            s["target_drafts_drafter"] += len(chain) - min(a0[b], len(chain))
            s["drafter_tokens"] += len(chain)
        self.stats["level0_s"] += t1 - t0
        self.stats["drafter_s"] += t2 - t1
        self.stats["steps"] += 1
        return out
