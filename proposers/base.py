"""Engine-agnostic proposer interface.

A proposer sees one `StepContext` per engine step: the batch in row order, what the target
did last step for every request (accepted tokens, the target's own output at every verified
position), and which requests left. It returns one draft chain per row. State is keyed by
request id, never by row: rows move between steps.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, get_type_hints

import numpy as np

if TYPE_CHECKING:
    import torch


# ---- configuration ---------------------------------------------------------------------------
def key(default: Any, lo: float | None = None, hi: float | None = None, help: str = "") -> Any:
    """A config field: its default, its allowed range (numbers) and its help text, in one place
    (`MethodConfig.keys()` hands them to validation and to the generated docs)."""
    meta = {"lo": lo, "hi": hi, "help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


GOODPUT_HELP = ("per step, keep only the draft tokens whose learned chance of acceptance pays for their "
                "measured verification cost, over the whole batch; draft nothing while drafting does not "
                "pay (false: always draft num_speculative_tokens)")


@dataclass(frozen=True)
class Key:
    """One config key as validation and the docs see it."""
    default: Any
    lo: float | None = None
    hi: float | None = None
    kind: type = int
    help: str = ""


_KINDS = (bool, int, float, str, list)


@dataclass
class MethodConfig:
    """Base of every method's typed config: a dataclass whose fields are the method's keys
    (`key(...)`: default, range, help). Constructing one checks every field's type and range,
    then the method's own cross-field rules (`check`), so an instance is always valid; the
    proposer takes it whole."""

    #: the speculative_config "method" name this config serves
    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            v, kind, lo, hi = getattr(self, f.name), _kind(hints[f.name]), f.metadata.get("lo"), f.metadata.get("hi")
            if v is None:
                if f.default is None:
                    raise ValueError(f"speculative_config.{f.name} is required for method {self.method!r} "
                                     f"({f.metadata.get('help', '')})")
                continue
            what = {int: "an integer", bool: "true or false", str: "a string", float: "a number",
                    list: "a list"}[kind]
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
                object.__setattr__(self, f.name, v)
            if isinstance(v, np.integer) and kind is int:
                v = int(v)
                object.__setattr__(self, f.name, v)
            if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
                raise ValueError(f"speculative_config.{f.name}={v!r} must be {what} ({f.metadata.get('help', '')})")
            if lo is not None and not (lo <= v <= hi):
                raise ValueError(f"speculative_config.{f.name}={v} is out of range for method {self.method!r}: "
                                 f"allowed {lo}..{hi} ({f.metadata.get('help', '')})")
        self.check()

    def check(self) -> None:
        """Cross-field rules of the method (ValueError naming the field)."""

    def drafter_folder(self) -> str | None:
        """The drafter model folder this configuration loads, if any (checked before start)."""
        return None

    @property
    def uses_trees(self) -> bool:
        """Whether the proposer drafts trees (tree attention runs; some models are refused)."""
        return False

    @property
    def needs_target(self) -> bool:
        """Whether building the proposer reads the target's weights (a drafter shares its head)."""
        return self.drafter_folder() is not None

    @classmethod
    def keys(cls) -> dict[str, Key]:
        hints = get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f.name] = Key(default, f.metadata.get("lo"), f.metadata.get("hi"), _kind(hints[f.name]),
                              f.metadata.get("help", ""))
        return out

    def to_dict(self) -> dict:
        return {"method": self.method, **dataclasses.asdict(self)}


def _kind(t) -> type:
    """int / bool / float / str / list from a field's annotation (`str | None` -> str)."""
    for k in _KINDS:
        if t is k or getattr(t, "__origin__", None) is k:
            return k
    for a in getattr(t, "__args__", ()):
        if a is not type(None):
            return _kind(a)
    raise TypeError(f"unsupported config field type {t!r}")


def check_prompt_lookup(cfg) -> None:
    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")


@dataclass
class BuildEnv:
    """What building a proposer needs from the engine besides its config."""
    vocab_size: int | None = None
    max_requests: int = 8
    #: folder -> a loaded drafter over the target's embeddings (the engine adapter supplies it)
    load_drafter: Any = None
    #: the target's model folder, for a config whose `needs_target` is set
    target: str | None = None


# ---- one engine step --------------------------------------------------------------------------
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
    # Requests that left since the last step (the proposer releases them). An engine that calls
    # `Proposer.release` itself as requests leave (vLLM's adapter does) passes them empty.
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
    #: steps taken, for proposers that count them (reports)
    steps: int = 0
    #: seconds of one-off per-request work so far (a new request's prompt scan): not a step's
    #: drafting cost (`Goodput` subtracts it), measured with `clock`
    once_seconds: float = 0.0
    clock = staticmethod(time.perf_counter)
    #: A costly proposer's cheap part alone (a cascade's model-free level, n-gram lookup beside a
    #: Mamba drafter), called as `propose` (it sets `classes` too), or None: what `Goodput` drafts
    #: while the costly part does not pay.
    propose_fallback = None
    #: whether the proposer's seconds per step do not grow with the chain length it is asked for
    #: (a lookup extends a chain in microseconds; a draft model runs once per token). `Goodput`
    #: then asks it for its whole budget, and each row's cut decides, even where its seconds per
    #: row make it a costly proposer (switched on and off by what it makes).
    depth_free: bool = False

    def __init__(self, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens
        self.states: dict[str, object] = {}
        self.stats: dict = {}

    # ---- per-request lifecycle -------------------------------------------------------------
    def new_state(self, req: RequestStep) -> object:
        return None

    def release(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- what the engine adapter reads (state reports, tensor parallelism) --------------------
    def request_ids(self) -> set[str]:
        """Requests this proposer holds state for."""
        return set(self.states)

    def state_nbytes(self, req_id: str) -> int:
        """Bytes held for one request."""
        return 0

    def summary(self) -> dict:
        """The proposer's own state for reports (bounded size): shared tables, learned statistics."""
        return {}

    def counters(self) -> dict:
        """Cumulative counters (tokens, seconds, steps), or {}."""
        return dict(self.stats)

    def set_sync(self, sync) -> None:
        """Tensor parallelism: `sync(obj) -> obj` makes every rank take rank 0's choices; a
        proposer whose drafts depend on measured time uses it, others ignore it."""

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


#: n-gram lookup in a request's own text drafting for the target alone (a drafter's cheap part,
#: `Proposer.propose_fallback`): the match lengths it looks for, and P(accepted | parent accepted)
#: by depth per match length 1, 2, >= 3, the priors of its classes (vLLM's `ngram`, matches of
#: 2-4 tokens, had 0.59 / 0.47 / 0.39 / 0.35 of its drafts per depth accepted on the fresh chat
#: prompts)
NGRAM_ALONE = (1, 3)
NGRAM_ALONE_PRIOR = ((0.3, 0.6, 0.7, 0.7), (0.5, 0.7, 0.75, 0.8), (0.6, 0.75, 0.8, 0.85))


def ngram_alone(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int,
                first_class: int) -> tuple[list[int], list[int]]:
    """Prompt lookup's chain and its token classes: `first_class` + (match length - 1) * 4 +
    depth, in the layout of `NGRAM_ALONE_PRIOR`."""
    chain, n = ngram_match(tokens, k, n_min, n_max)
    depths = len(NGRAM_ALONE_PRIOR[0])
    base = first_class + (min(n, len(NGRAM_ALONE_PRIOR)) - 1) * depths
    return chain, [base + min(j, depths - 1) for j in range(len(chain))]


def ngram_lookup(tokens: Sequence[int] | np.ndarray, k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    """Prompt-lookup: find the latest earlier occurrence of the last n tokens (longest n first)
    and return up to k tokens that followed it."""
    return ngram_match(tokens, k, n_min, n_max)[0]


def ngram_match(tokens: Sequence[int] | np.ndarray, k: int, n_min: int = 1, n_max: int = 3) -> tuple[list[int], int]:
    """`ngram_lookup`'s tokens and the length n of the match they follow (0: none). One pass
    over the text: the earlier positions holding the last token, then how far back each agrees."""
    t = np.asarray(tokens)
    L = len(t)
    top = min(n_max, L - 1)
    if top < n_min:
        return [], 0
    ends = np.flatnonzero(t[:L - 1] == t[L - 1])     # where a match of the last tokens could end
    n_agree = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, top):
        at = ends - j
        alive &= at >= 0
        alive[alive] = t[at[alive]] == t[L - 1 - j]
        if not alive.any():
            break
        n_agree += alive
    n = int(n_agree.max(initial=0))
    if n < n_min:
        return [], 0
    start = int(ends[np.flatnonzero(n_agree >= n)[-1]]) + 1     # the latest of the longest
    return t[start:start + k].tolist(), n
