"""Engine-agnostic proposer interface.

A proposer sees one `StepContext` per engine step: the batch in row order, what the target
did last step for every request (accepted tokens, the target's own output at every verified
position), and which requests left. It returns one draft chain per row. State is keyed by
request id, never by row: rows move between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class RequestStep:
    """What one request did in the last target step."""

    req_id: str
    # Every token of the request so far: prompt + output, including `sampled` (read-only view).
    token_ids: np.ndarray
    # Tokens appended this step: accepted drafts followed by the target's bonus token.
    # Empty while the prompt is still being prefilled in chunks.
    sampled: list[int]
    # The drafts that were verified this step (what we proposed last step; may be empty).
    drafts: list[int]
    # Target argmax at each verified position: len(drafts) + 1 entries, entry i is the target's
    # prediction after the prefix + drafts[:i]. None when the runner did not collect it.
    target_argmax: list[int] | None = None
    # When the drafts were a tree: parent index per draft (-1 = root), and the accepted nodes.
    # target_argmax then has one entry per tree row (row 0 = root, row 1+i = node i).
    tree_parents: list[int] | None = None
    accepted_nodes: list[int] | None = None
    # False when the engine can only verify a chain for this request (e.g. logprobs or
    # penalties requested): a tree returned for it is cut to its first root-to-leaf path.
    tree_ok: bool = True
    # The request's `SamplingParams.extra_args` (traffic tags, e.g. a category), if any.
    tags: dict | None = None
    # The target's final hidden state at each verified position (one row per `target_argmax`
    # entry: the output head over row i gives the target's logits there), when the proposer sets
    # `needs_hidden_states` and the engine has them. A view valid during `propose` only.
    hidden_states: "torch.Tensor | None" = None
    # Greedy decoding (temperature 0): `sampled` is the target's argmax along the accepted path.
    greedy: bool = False
    # Who may see this request's text in shared state (vLLM's per-tenant `cache_salt`); None: the
    # default tenant. State shared across requests is kept apart per tenant.
    tenant: str | None = None

    @property
    def num_accepted(self) -> int:
        """Drafts accepted this step (0 when there were none)."""
        return max(len(self.sampled) - 1, 0) if self.drafts else 0


@dataclass
class StepContext:
    requests: list[RequestStep]           # batch rows, in order
    finished_req_ids: set[str] = field(default_factory=set)   # finished or aborted
    preempted_req_ids: set[str] = field(default_factory=set)  # will be recomputed on resume
    # Max drafts per request this step: the engine's per-step budget (vLLM's dynamic
    # speculative decoding schedule `num_speculative_tokens_per_batch_size`, 0 = no speculation
    # this step); None = the proposer's own k.
    num_speculative_tokens: int | None = None
    # Tokens the target ran in the step that just finished (prefill, decode and drafts), when the
    # engine reports it (cost models); None: count 1 + verified drafts per row.
    num_scheduled_tokens: int | None = None

    def tokens_run(self) -> int:
        """`num_scheduled_tokens`, or 1 + verified drafts per row when the engine gives none."""
        if self.num_scheduled_tokens is not None:
            return self.num_scheduled_tokens
        return sum(1 + len(r.drafts) for r in self.requests)

    def budget(self, k: int) -> int:
        """Drafts a proposer with max `k` may return per request this step."""
        return k if self.num_speculative_tokens is None else max(0, min(k, self.num_speculative_tokens))


class Proposer:
    """Base class. Subclasses implement `propose_one` (and usually `observe`)."""

    #: set True if the proposer wants `RequestStep.target_argmax` (costs one argmax per step)
    needs_target_argmax: bool = False
    #: set True if the proposer wants `RequestStep.hidden_states` (views, no copy)
    needs_hidden_states: bool = False
    #: Token classes for `Goodput` (acceptance is learned per class): `propose` sets `classes`,
    #: one list per row aligned with its draft; `class_prior` is each class's rate before any
    #: evidence (len = number of classes). None: classes by depth alone.
    class_prior = None
    classes: list[list[int]] | None = None

    def __init__(self, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens
        self.states: dict[str, object] = {}

    # ---- per-request lifecycle -------------------------------------------------------------
    def new_state(self, req: RequestStep) -> object:
        return None

    def release(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- per-step ----------------------------------------------------------------------------
    def observe(self, state: object, req: RequestStep) -> None:
        """Update `state` with what the target did for this request last step."""

    def propose_one(self, state: object, req: RequestStep, k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, ctx: StepContext) -> list:
        """One draft per row: a list of token ids (a chain) or a `DraftTree`."""
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        k = ctx.budget(self.k)
        out: list[list[int]] = []
        self.classes = [] if self.class_prior is not None else None
        for req in ctx.requests:
            state = self.states.get(req.req_id)
            if state is None:
                state = self.states[req.req_id] = self.new_state(req)
            self._classes: list[int] = []    # propose_one may fill it (token classes, see `classes`)
            if not req.sampled:          # prompt chunk still prefilling: nothing to draft
                drafts = []
            else:
                self.observe(state, req)
                drafts = self.propose_one(state, req, k) if k > 0 else []
                if not hasattr(drafts, "parents"):
                    drafts = list(drafts[:k])
            out.append(drafts)
            if self.classes is not None:
                self.classes.append(self._classes[:len(drafts)])
        return out


def ngram_lookup(tokens: Sequence[int] | np.ndarray, k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    """Prompt-lookup: find the latest earlier occurrence of the last n tokens (longest n first)
    and return up to k tokens that followed it."""
    t = np.asarray(tokens)
    L = len(t)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = t[L - n:]
        # windows of length n ending before the suffix itself
        win = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)
        hits = np.nonzero((win == suffix).all(axis=1))[0]
        if len(hits):
            start = hits[-1] + n
            return t[start: start + k].tolist()
    return []
