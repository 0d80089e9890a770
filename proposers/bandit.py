"""`bandit_tree`: a draft tree whose shape (nodes per depth) is chosen online by a bandit.

The drafter is the lookahead pool (prompt lookup, n-grams from the text and from the target's
own Jacobi iterations, and the Jacobi window; `proposers/lookahead.py`), or a Mamba drafter
(`proposers/mamba.py`: its greedy chain and, per depth, its next-best tokens as leaves, scored by
its own probabilities; its state rolls back through per-depth snapshots as for a chain): either
scores every candidate node with its estimated probability of acceptance. A shape `widths`
keeps, best first, at most `widths[d]` nodes at depth d+1 (`shaped_tree`). The family of shapes
(`shape_family`) runs from no speculation at all, through plain chains, to wide-then-narrow
trees within the node budget. With the lookahead pool a chain arm drafts `lookahead`'s chain
form and cuts it per token as `goodput` does (`_chain_keep`): one chain, as deep as the deepest
shape, stands for every depth, since the cut sets each row's length from its tokens' chances;
the cut is the back-off too (nothing is kept where drafting does not pay), so there "no
speculation" is not chosen, only pulled to keep a plain step's cost measured.

The bandit is discounted UCB (Garivier & Moulines 2011) over that family, one table per
context = (traffic key, batch-size bucket). An arm's value is tokens per second per request
slot, what a user pays for: the tokens a step makes per request with that shape (accepted drafts
+ 1, observed) over the seconds of a step with that shape at the current batch size. The
seconds are priced by a cost model fitted online to every step's measured time (`StepCost`,
shared with `goodput`: a + b * verified tokens + p * prefill tokens + a jump for any step that
verifies drafts, growing with the batch, + e * the context the decoding rows attend to; the time
between two proposals, drafting included), times the arm's own mean
ratio of measured to predicted seconds, predicted by the model as fitted now (what the linear
model misses: a tree step's mask, a wide tree's drafting). Why not each arm's mean raw step
time: under continuous traffic every step also runs prefill work whose size has nothing to do
with the arm, and at large batches that noise swamps the drafts' own cost; the fit prices the
prefill tokens apart, every step informs it, and an arm is priced at any batch size. The context term
matters as much: one table sees every kind of traffic of its bucket, and without it an arm pulled
during long-context steps (summaries) carries their cost into short-context ones. Why UCB,
discounted:
* tokens per step are a small noisy count with no convenient conjugate model for the ratio
  Thompson sampling would need, while UCB only needs a scale (the best arm's value here);
* the best shape drifts with the text (a code block, then prose) and across requests; a
  discount (effective memory 1/(1-discount) steps) forgets, and the bonus of a forgotten arm
  grows back, so it is re-tried;
* deterministic given the observations, cheap (a loop over ~10 arms per step), no host sync.
An arm is scored without being pulled where the step's tokens tell what it would have made: a
sub-tree of the verified tree, "no speculation", and, in greedy steps, the chain arm (drafted
unverified beside a tree, and every `SHADOW_EVERY`-th step of "no speculation"), so a chain arm
is taken up again when the text starts to repeat.
The batch size is context twice: in the price (the cost of a draft token grows with the batch:
at batch 32 on a CPU nothing pays, and the chain arm's cut keeps nothing, or "no speculation"
wins where no arm is cut: that is the back-off) and in the table (a new batch bucket starts from
the token counts and cost ratios of the nearest one: acceptance does not depend on the batch,
the ratios little).
One shape serves every row of a step, but rows differ: a chat row whose candidates are weak
beside a code row that repeats its prompt. With `row_gate`, a tree's node whose chance of
acceptance is not above `node_price` (what one more verified node costs, in tokens, at the
step's rate: goodput's rule per token) is left out of every shape, and a row with no such node
drafts nothing that step; every `GATE_EXPLORE`-th step (rows in turn) a row drafts its arm's
whole shape anyway, so the rates of classes under the price stay measured (they change only
where their nodes are verified). Without it every arm is priced with rows and nodes that cannot
pay, and a whole-tree rule (a row drafts its arm's whole tree where the tree's summed chances
pay for its nodes) still verifies the tail nodes that do not.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from .base import BuildEnv, MethodConfig, Proposer, RequestStep, StepContext, check_prompt_lookup, key
from .cost import StepCost, batch_bucket, continues, mean_context, step_features
from .goodput import SHADOW_EVERY, AcceptModel, chances, drafting_pays, observe_chain, price_cut
from .lookahead import SHARED_POOL_HELP, LookaheadConfig, LookaheadProposer, _select, shaped_tree

logger = logging.getLogger("vllm_spec_plugins")

def shape_family(max_depth: int, max_width: int, node_budget: int, backoff: bool = True,
                 ladder: bool = True) -> list[tuple]:
    """No speculation (if `backoff`), chains of depth 1, 2, 4, ... max_depth (`ladder`; else the
    chain of depth max_depth alone: a drafter whose chains are cut per token needs no other),
    and for each depth >= 2 a tree whose first level is max_width wide (narrower if needed to
    fit `node_budget`), halving per level (at least 1). Small on purpose (8 arms for 6/4/16, 5
    without the ladder): every arm costs exploration."""
    depths = sorted({d for d in (1, 2, 4, 8, 16, 32) if d < max_depth} | {max_depth})
    out: list[tuple] = [()] if backoff else []
    for d in depths:
        for w in ((1,) if ladder or d == max_depth else ()) + ((max_width,) if d > 1 else ()):
            s = tuple(max(w >> j, 1) for j in range(d))
            while sum(s) > node_budget and w > 1:
                w -= 1
                s = tuple(max(w >> j, 1) for j in range(d))
            if sum(s) <= node_budget and s not in out:
                out.append(s)
    return out


def greedy_tokens(nodes: list[tuple[int, int, int]], made: list[int]) -> int | None:
    """Tokens a draft tree would have made in a greedy step that made `made` (its accepted drafts
    and the bonus token: made[i] is the target's argmax after made[:i]). nodes: (id, token,
    parent id or -1). None where it depends on a target token past `made` (the tree accepts all
    of them and goes on below)."""
    up, n = -1, 0
    while True:
        kids = [(j, t) for j, t, p in nodes if p == up]
        if n == len(made):
            return None if kids else n + 1
        up = next((j for j, t in kids if t == made[n]), None)
        if up is None:
            return n + 1
        n += 1


def shape_name(s: tuple) -> str:
    return "-".join(map(str, s)) if s else "none"


UNIT = (1.0,) + (0.0,) * (StepCost.N_FEATURES - 1)     # cost features / weights of "1 per step"


class DiscountedUCB:
    """Arms 0..n-1. An arm's rate is its mean tokens per request per step over its price: the cost
    model's prediction for a step with it times the arm's own ratio of measured to predicted
    seconds over its pulls (what the linear model misses, e.g. a tree step's mask). The ratio is
    taken against the cost model as it is now (`rate(w=...)`: each pull's cost features are kept,
    summed): ratios against the model of the time go stale as its fit moves, and would sink arms
    pulled early. Tokens,
    discounted, are also known for arms that were not pulled: a shape whose tree is a subset of
    the verified one would have accepted exactly the verified accepted nodes inside it
    (`step(tokens=...)`), "no speculation" always makes 1, and in a greedy step with the Mamba
    drafter so is every arm no deeper than the pulled one (`greedy_tokens`: its tree is drafted
    as wide as the widest arm). Ratios are only measured for
    the pulled arm, and its first `warmup` pulls are not: the first steps of a new token count
    pay one-off kernel set-up (oneDNN here, CUDA graphs / autotuning on GPUs).

    choose(price, allowed): an arm without a token or ratio measurement first, then
    argmax rate + c * best_rate * sqrt(2 ln N / n_a), n_a = min(token obs., 4 x ratio obs.):
    a step's time is a few times less noisy than its tokens."""

    def __init__(self, n_arms: int, exploration: float, discount: float, warmup: int = 1):
        self.c, self.g, self.warmup = exploration, discount, warmup
        self.ntok = [0.0] * n_arms
        self.tok = [0.0] * n_arms
        self.nres = [0.0] * n_arms
        self.res = [0.0] * n_arms                        # measured seconds
        self.resx = [[0.0] * len(UNIT) for _ in range(n_arms)]   # their steps' cost features
        self.pulls = [0] * n_arms

    def tokens(self, a: int) -> float | None:
        return self.tok[a] / self.ntok[a] if self.ntok[a] > 1e-9 else None

    def rate(self, a: int, price: list[float], w=UNIT) -> float | None:
        """Mean tokens / (price * measured over predicted seconds); w: the cost model's weights
        (`StepCost.weights`; the default predicts 1 per step: the ratio is the mean seconds)."""
        if self.ntok[a] < 1e-9 or self.nres[a] < 1e-9:
            return None
        ratio = self.res[a] / max(sum(c * x for c, x in zip(w, self.resx[a])), 1e-12)
        return self.tok[a] / self.ntok[a] / max(price[a] * ratio, 1e-9)

    def choose(self, price: list[float], allowed: list[int] | None = None, w=UNIT) -> int:
        arms = range(len(self.ntok)) if allowed is None else allowed
        for a in arms:
            if self.nres[a] < 1e-3 or self.ntok[a] < 1e-3:
                return a
        rates = {a: self.rate(a, price, w) or 0.0 for a in arms}
        scale = max(rates.values()) or 1.0
        n = {a: min(self.ntok[a], 4 * self.nres[a]) for a in arms}
        log_n = math.log(max(sum(self.nres[a] for a in arms), 1.0))
        return max(arms, key=lambda a: rates[a] + self.c * scale * math.sqrt(2 * log_n / n[a]))

    def step(self, arm: int, tokens: dict[int, float], seconds: float | None = None, x=UNIT) -> bool:
        """One step: `arm` was pulled, its step took `seconds` with cost features `x`
        (`StepCost.features`); `tokens` {arm: tokens per request} for the pulled arm and every
        arm whose outcome is known. Returns whether the step's time counts (past the arm's warmup)."""
        g = self.g
        self.ntok = [v * g for v in self.ntok]
        self.tok = [v * g for v in self.tok]
        self.nres = [v * g for v in self.nres]
        self.res = [v * g for v in self.res]
        self.resx = [[v * g for v in r] for r in self.resx]
        for a, t in tokens.items():
            self.ntok[a] += 1.0
            self.tok[a] += t
        self.pulls[arm] += 1
        timed = self.pulls[arm] > self.warmup
        if timed and seconds is not None:
            self.nres[arm] += 1.0
            self.res[arm] += seconds
            self.resx[arm] = [r + v for r, v in zip(self.resx[arm], x)]
        return timed

    def seed(self, other: "DiscountedUCB", weight: float = 8.0) -> None:
        """Start from `other`'s token and ratio means, each worth at most `weight` observations."""
        for n_, v_, mine_n, mine_v in ((other.ntok, other.tok, self.ntok, self.tok),
                                       (other.nres, other.res, self.nres, self.res)):
            for a, n in enumerate(n_):
                if n > 1e-9:
                    w = min(n, weight)
                    mine_n[a], mine_v[a] = w, v_[a] / n * w
        for a, n in enumerate(other.nres):
            if n > 1e-9:
                self.resx[a] = [v / n * min(n, weight) for v in other.resx[a]]


MAMBA_FOLDER_HELP = ("its folder (`python -m vllm_spec_plugins.tools.drafters --drafter mamba`) or "
                     "'vllm_spec_plugins:smollm2-135m-instruct-mamba' (shipped)")


@dataclass
class BanditTreeConfig(MethodConfig):
    method = "bandit_tree"
    num_speculative_tokens: int = key(16, 1, 64, "draft tokens the scheduler reserves per request (>= node_budget)")
    drafter: str = key("lookahead", help="what proposes candidates per depth: 'lookahead' (model-free pool) or "
                       "'mamba' (the Mamba drafter's greedy chain and its next-best tokens per depth)")
    model: str = key("", help="drafter 'mamba': " + MAMBA_FOLDER_HELP)
    node_budget: int = key(0, 0, 64, "max tree nodes per request (0 = num_speculative_tokens)")
    max_depth: int = key(6, 1, 64, "deepest shape in the generated family")
    max_width: int = key(4, 1, 64, "widest first level in the generated family")
    shapes: list = key([], help="explicit shape family: list of width lists ([] in it = no speculation); "
                       "one shape = fixed")
    batch_node_budget: int = key(64, 1, 1 << 16, "draft nodes per step across the batch: shapes over "
                                 "budget/batch_size nodes are not tried")
    backoff: bool = key(True, help="include the no-speculation arm in the generated family (with drafter "
                        "'lookahead' and row_gate, while a verified node costs under half a token, pulled only "
                        "for the cost fit's plain steps: the chain arm, cut per token, drafts nothing where "
                        "drafting does not pay)")
    scope: str = key("global", help="bandit tables: 'global', 'request', or 'field:NAME' "
                     "(SamplingParams.extra_args[NAME])")
    exploration: float = key(0.05, 0.0, 10.0, "UCB exploration weight c (times the best mean reward)")
    discount: float = key(0.995, 0.5, 1.0, "per-step discount of the bandit's counts (memory ~ 1/(1-discount) steps)")
    row_gate: bool = key(True, help="leave out of every shape the nodes whose chance of acceptance is not above "
                         "what a verified node costs (the cost fit's price, in tokens); a request with none "
                         "drafts nothing that step")
    window: int = key(0, 0, 64, "drafter: Jacobi window W (0 = deepest shape)")
    ngram: int = key(4, 2, 16, "drafter: n-gram size N")
    guesses: int = key(7, 1, 64, "drafter: n-gram candidates kept per key token")
    pool_cap: int = key(4096, 16, 1 << 20, "drafter: max n-grams per request (LRU eviction)")
    shared_pool: int = key(65536, 0, 1 << 22, "drafter: lookahead's `shared_pool` (unused with drafter 'mamba'): "
                           + SHARED_POOL_HELP)
    prompt_lookup_min: int = key(1, 1, 16, "drafter: prompt-lookup min match length")
    prompt_lookup_max: int = key(3, 1, 16, "drafter: prompt-lookup max match length")

    @property
    def budget(self) -> int:
        return self.node_budget or self.num_speculative_tokens

    def family(self) -> list[tuple]:
        # the lookahead pool's chains are cut per token (`_chain_keep`): one chain arm serves all depths
        shapes = self.shapes or shape_family(self.max_depth, self.max_width, self.budget, self.backoff,
                                             ladder=self.drafter != "lookahead")
        return [tuple(w) for w in shapes]

    def check(self) -> None:
        check_prompt_lookup(self)
        k, budget = self.num_speculative_tokens, self.budget
        if budget > k:
            raise ValueError(f"speculative_config.node_budget={budget} must be <= num_speculative_tokens={k} "
                             "(the scheduler's draft budget)")
        for name in ("max_depth", "max_width"):
            if getattr(self, name) > budget:
                raise ValueError(f"speculative_config.{name}={getattr(self, name)} must be <= node_budget={budget}")
        if self.drafter not in ("lookahead", "mamba"):
            raise ValueError(f"speculative_config.drafter={self.drafter!r}: bandit_tree drafts candidates with "
                             "'lookahead' (model-free) or 'mamba' (a Mamba drafter, speculative_config.model)")
        if self.drafter == "mamba" and not self.model:
            raise ValueError("speculative_config.model is required with drafter 'mamba': " + MAMBA_FOLDER_HELP)
        if self.drafter == "lookahead" and self.model:
            raise ValueError(f"speculative_config.model={self.model!r} is only used with drafter 'mamba' "
                             "(drafter 'lookahead' is model-free)")
        scope = self.scope
        if not (scope in ("global", "request") or (scope.startswith("field:") and len(scope) > 6)):
            raise ValueError(f"speculative_config.scope={scope!r} must be 'global', 'request' or 'field:NAME'")
        for sh in self.shapes:
            if not isinstance(sh, (list, tuple)) or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1
                                                            for w in sh):
                raise ValueError("speculative_config.shapes: each shape is a list of widths >= 1 (nodes per "
                                 f"depth), got {sh!r}")
            if sum(sh) > budget:
                raise ValueError(f"speculative_config.shapes: shape {list(sh)} has {sum(sh)} nodes > "
                                 f"node_budget={budget}")
        if not self.family():
            raise ValueError("speculative_config: the bandit's shape family is empty")
        if self.window > k:
            raise ValueError(f"speculative_config.window={self.window} must be <= num_speculative_tokens={k}")
        if self.ngram > k + 1:
            raise ValueError(f"speculative_config.ngram={self.ngram} must be <= num_speculative_tokens + 1 = {k + 1}")

    def drafter_folder(self) -> str | None:
        return self.model if self.drafter == "mamba" else None

    uses_trees = True

    def lookahead(self) -> LookaheadConfig:
        """The lookahead pool that drafts the candidates: the tree form at this node budget."""
        k, depth = self.num_speculative_tokens, max(map(len, self.family())) or 1
        return LookaheadConfig(num_speculative_tokens=k, window=min(self.window or depth, k),
                               ngram=min(self.ngram, k + 1), guesses=self.guesses, pool_cap=self.pool_cap,
                               shared_pool=self.shared_pool if self.drafter == "lookahead" else 0,
                               prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                               tree=True, tree_nodes=self.budget, goodput=False)

    def build(self, env: BuildEnv) -> Proposer:
        drafter = env.load_drafter(self.model) if self.drafter == "mamba" else None
        return BanditTreeProposer(self, vocab_size=env.vocab_size, drafter=drafter, max_requests=env.max_requests)


class BanditTreeProposer(Proposer):
    """The lookahead pool's tree form (or, with `drafter`, a Mamba drafter:
    `MambaProposer.draft_tree`) drafts candidates; a shape bandit chooses how many of them to
    keep per depth. `scope`: "global" (one table per batch bucket), "request" (one per request,
    freed with it), or "field:NAME" (one per value of the request's
    `SamplingParams.extra_args[NAME]`, e.g. a traffic category; missing -> "global")."""

    needs_target_argmax = True

    def __init__(self, cfg: BanditTreeConfig, vocab_size: int | None = None, drafter=None, max_requests: int = 8,
                 log_every: int = 500, history: int = 20000, clock=time.perf_counter):
        super().__init__(cfg.num_speculative_tokens)
        self.cfg = cfg
        shapes = cfg.family()
        depth = max(len(s) for s in shapes) or 1
        #: candidates and their scores: the lookahead pool's tree form (its state per request)
        la = cfg.lookahead() if drafter is None else replace(cfg.lookahead(), shared_pool=0)   # the drafter drafts
        self.lookahead = LookaheadProposer(la, vocab_size=vocab_size)
        self.states = self.lookahead.states
        self.shapes, self.exploration, self.discount, self.scope = shapes, cfg.exploration, cfg.discount, cfg.scope
        self.row_gate = cfg.row_gate
        self.batch_node_budget = cfg.batch_node_budget
        #: a Mamba drafter (`StateSpaceDrafter`) drafts the candidates instead of the lookahead pool
        self.mamba = None
        if drafter is not None:
            from .mamba import MambaProposer
            self.mamba = MambaProposer(depth, drafter, max_requests)
        self.once_s = 0.0                    # the drafter's one-off seconds in the last proposal
        self._allowed: dict[int, list[int]] = {}
        self.none_arm = self.shapes.index(()) if () in self.shapes else None
        self.subsets: dict[str, tuple] = {}   # req id -> (nodes, is chain, {arm: node set}) drafted last step
        # (traffic key, batch bucket) -> bandit; least recently used first. `field:NAME` keys come
        # from request fields a client chooses: at most MAX_TABLES are kept.
        self.tables: OrderedDict[tuple, DiscountedUCB] = OrderedDict()
        self.pending: dict[tuple, tuple[int, list[str]]] = {}   # context -> (arm, request ids) of last step
        self.last_start: float | None = None
        self._ids: set = set()                   # request ids of the last step (`continues`)
        self.cost = StepCost()               # seconds of a step, from the time between proposals
        # nodes an arm drafts per request (its price): the shape's size until its first step, then
        # measured (`NODE_MEMORY`)
        self.nodes = [float(sum(sh)) for sh in self.shapes]
        # share of an arm's steps that verified any draft (they alone pay the cost fit's jump):
        # every step until its first, then measured as `nodes` is. Priced with the jump on every
        # pull, a chain arm whose cut keeps nothing (most chat steps at batch 8) was priced as
        # dear as a drafting one (the jump: ~10% of a batch-8 step on a 2-core CPU) and the
        # bandit stayed on "no speculation" through whole categories that repeat their prompt
        self.drafting = [1.0 if sh else 0.0 for sh in self.shapes]
        self.node_steps = [0] * len(self.shapes)
        self.context = 0.0                   # mean context length of the last step's decoding rows
        self.steps = 0
        self.draft_seconds = 0.0
        self.history: deque = deque(maxlen=history)   # (step, key, bucket, arm, reward)
        self.log_every, self.clock = log_every, clock
        #: `set_sync`: under tensor parallelism every rank uses rank 0's arms, node price and cuts
        self.sync = None
        #: with the lookahead pool, chain arms (widths all 1) draft its chain form, each token
        #: classed by where it came from; `accept` learns the classes' rates as `goodput` does and
        #: `_chain_keep` keeps what pays. Against chains of 1, 2, 4 and 6 tokens taken from the
        #: tree form's best path and cut by its per-request node scores, replayed over the
        #: held-out split (`scripts/goodput_replay.py`, four request orders, an AVX-512 bf16
        #: host's cost model): batch 8 2.8% faster (chat 1.4%, code 1.7%, summaries 5.9%), batch 1
        #: within 0.2%
        self.chain_arms = {i for i, sh in enumerate(self.shapes) if sh and max(sh) == 1} if drafter is None else set()
        #: with the cut (`row_gate`), a chain arm drafts nothing where drafting does not pay: it is
        #: the back-off, and "no speculation" is pulled only for the cost fit's plain steps. Chosen
        #: beside the chain arm, "no speculation" held the first hundreds of batch-8 steps of
        #: categories that repeat their source (served at batch 8; replayed with step-time noise:
        #: tau on summaries 1.42 against 2.1-2.3), while the chain arm was priced at the nodes it
        #: drafted when last pulled
        #: (while a verified node costs under `CUT_BACKOFF_PRICE` tokens: `propose`)
        self.backoff_by_cut = bool(self.chain_arms) and self.row_gate and self.none_arm is not None
        self.accept = AcceptModel(LookaheadProposer.class_prior)
        #: req id -> (classes, tokens) of the chain drafted for it last step: what was handed out
        #: (tokens None) or, for a greedy row, that and the first token cut, or a chain arm's
        #: chain beside another arm (`observe_chain`)
        self.sent: dict[str, tuple[list[int], list[int] | None]] = {}
        #: req id -> each token's chance of acceptance in the chain a chain arm would have drafted
        #: last step (`_counterfactual`)
        self.reach: dict[str, list[float]] = {}

    # one clock for the bandit and its drafter: the drafter's one-off seconds are subtracted from ours
    @property
    def clock(self):
        return self._clock

    @clock.setter
    def clock(self, clock) -> None:
        self._clock = self.lookahead.clock = clock
        if self.mamba is not None:
            self.mamba.clock = clock

    def set_sync(self, sync) -> None:
        self.sync = sync

    def request_ids(self) -> set[str]:
        return set(self.lookahead.states) | (set(self.mamba.slots) if self.mamba is not None else set())

    def summary(self) -> dict:
        return {"bandit": self.inspect(), **self.lookahead.summary()}

    def _once_total(self) -> float:
        """One-off seconds so far (the pool's first indexing of prompts, the drafter's prompt
        scans): no arm's cost."""
        return self.lookahead.once_seconds + (self.mamba.once_seconds if self.mamba is not None else 0.0)

    # ---- traffic keys ------------------------------------------------------------------------
    def key_of(self, req: RequestStep) -> str:
        if self.scope == "global":
            return "global"
        if self.scope == "request":
            return req.req_id
        v = (req.tags or {}).get(self.scope[6:])
        return "global" if v is None else str(v)

    def release(self, req_id: str) -> None:
        self.lookahead.release(req_id)
        self.accept.release(req_id)
        self.sent.pop(req_id, None)
        self.subsets.pop(req_id, None)
        if self.mamba is not None:
            self.mamba.release(req_id)
        if self.scope == "request":
            for ctx in [c for c in self.tables if c[0] == req_id]:
                del self.tables[ctx]
            for ctx in [c for c in self.pending if c[0] == req_id]:
                del self.pending[ctx]

    def state_nbytes(self, req_id: str) -> int:
        n = self.lookahead.state_nbytes(req_id)
        if self.mamba is not None and req_id in self.mamba.slots:
            n += self.mamba.state_nbytes(req_id)
        return n

    def allowed(self, bucket: int) -> list[int]:
        """Arms whose nodes fit the batch's share of `batch_node_budget` (at least the smallest
        arms): at large batches every draft token costs real compute, and exploring a 16-node
        tree for 32 requests costs more than it can teach. A chain cut per token (`chain_arms`)
        always fits: it keeps only the tokens that pay at the batch's price."""
        a = self._allowed.get(bucket)
        if a is None:
            cap = max(self.batch_node_budget // bucket, 1)
            a = [i for i, s in enumerate(self.shapes) if sum(s) <= cap or i in self.chain_arms]
            if not a:
                least = min(sum(s) for s in self.shapes)
                a = [i for i, s in enumerate(self.shapes) if sum(s) == least]
            a = self._allowed[bucket] = a
        return a

    MAX_TABLES = 1024

    def table(self, ctx: tuple) -> DiscountedUCB:
        t = self.tables.get(ctx)
        if t is not None:
            self.tables.move_to_end(ctx)
            return t
        t = self.tables[ctx] = DiscountedUCB(len(self.shapes), self.exploration, self.discount)
        near = min((c for c in self.tables if c[0] == ctx[0] and c != ctx),
                   key=lambda c: abs(c[1].bit_length() - ctx[1].bit_length()), default=None)
        if near is not None:
            t.seed(self.tables[near])
        return t

    def price(self, n: int) -> list[float]:
        """Predicted seconds of a step of `n` decoding requests, at the last step's mean context
        length, with each arm (1.0 for all before any step was measured); the jump weighs as
        much as the share of the arm's steps that verified drafts (`drafting`)."""
        fit = self.cost.fit(max(n, 1), self.context)
        if fit is None:
            return [1.0] * len(self.shapes)
        return [fit.seconds(n * (1 + self.nodes[i])) + fit.jump * self.drafting[i] for i in range(len(self.shapes))]

    #: a row drafts its arm's whole shape, cut or not, every GATE_EXPLORE-th step (rows in turn):
    #: a class's rate changes only where its nodes are verified. Replayed over the held-out split at
    #: batch 8 (six request orders), every 8th step cost chat ~5% against no exploration, every
    #: 64th ~1% (within the orders' spread)
    GATE_EXPLORE = 64

    #: every CHAIN_EXPLORE-th step, one chain row (in turn) keeps one token past its cut, so the
    #: classes under the price stay measured (`Goodput.explore_every`)
    CHAIN_EXPLORE = 4

    #: the chain arm's cut stands in for "no speculation" (`backoff_by_cut`) only while a verified
    #: node costs under this many tokens (`node_price`). Where it costs more (batch 8 with
    #: verification as dear as on AVX2: ~0.7 of a token), the tree arms' explored and gated
    #: nodes, priced near break-even, lost 3-10% against plain with "no speculation" out of the
    #: family (replayed with that host's cost model; served 0.95x / 0.97x / 0.95x), and it is
    #: offered again; batch 8 on AVX-512 (~0.25) keeps the cut as the back-off
    CUT_BACKOFF_PRICE = 0.5

    #: steps over which an arm's nodes per request are averaged before an EMA of this memory takes
    #: over. The shape's size stands in until its first step: rows cut to the nodes that pay draft
    #: far fewer (at batch 8 on chat, ~1 node of a 6-node chain), and an EMA from that start priced
    #: a rarely pulled arm as if it drafted its whole shape for tens of steps, so it was never
    #: pulled again.
    NODE_MEMORY = 10

    def node_price(self, n: int) -> float:
        """Tokens one more verified node costs at batch `n`, at the rate of a step without
        drafts: b * n / (a + b * n) from the cost fit, b the first draft's price (`Price.token`; 0
        before any step was measured). A node pays
        where its chance of acceptance is above this (goodput's rule)."""
        fit = self.cost.fit(max(n, 1), self.context)
        if fit is None:
            return 0.0
        n = max(n, 1)
        return fit.token(n) * n / max(fit.seconds(n), 1e-12)

    def rates(self, ctx: tuple) -> list[float | None]:
        """Tokens per second per request of each arm in context `ctx` at its bucket's batch size
        (None while its tokens are unmeasured)."""
        t, price = self.tables[ctx], self.price(ctx[1])
        w = self.cost.weights() or UNIT
        return [t.rate(a, price, w) for a in range(len(self.shapes))]

    # ---- one step ----------------------------------------------------------------------------
    def propose(self, ctx: StepContext) -> list:
        now = self.clock()
        for rid in ctx.finished_req_ids | ctx.preempted_req_ids:
            self.release(rid)
        live = [r for r in ctx.requests if r.sampled]
        self._ids, timed = continues(self._ids, ctx.requests)
        if self.last_start is not None and timed:
            # A new request's prompt scan by the drafter is one-off work that no arm chose: not a
            # step cost (one such scan in a handful of pulls sank a tree arm for a whole run).
            seconds, f = now - self.last_start - self.once_s, step_features(ctx)
            timing = None          # (seconds within [1/3, 3] x predicted: one stall must not sink an arm, features)
            if self.cost.n:
                pred = max(self.cost.predict(**f), 1e-9)
                timing = (min(max(seconds, pred / 3), 3 * pred), self.cost.features(**f))
            if not self.pending or self._reward(live, seconds, timing):
                self.cost.observe(seconds=seconds, **f)
        for r in live:                    # the chains drafted: their classes learn
            sent = self.sent.get(r.req_id)
            if sent is not None:
                observe_chain(self.accept, r, *sent)
        self.sent = {}
        self.pending, self.subsets, self.reach = {}, {}, {}
        while len(self.tables) > self.MAX_TABLES:      # rewards are in: the least recently used go
            self.tables.popitem(last=False)
        bucket = batch_bucket(len(live))
        keys = sorted({self.key_of(r) for r in live})
        if live:
            self.context = mean_context(live)
        price = self.price(len(live))
        # a step without drafts now and then keeps the cost fit's jump measured
        plain = self.none_arm is not None and self.cost.n > 0 and self.cost.plain_weight < 0.5
        w = self.cost.weights() or UNIT
        node_price = self.node_price(len(live)) if self.row_gate else 0.0
        if self.sync is not None:      # priced from measured time: rank 0's, or the ranks' trees differ
            node_price = self.sync(node_price)
        backoff = self.backoff_by_cut and node_price < self.CUT_BACKOFF_PRICE
        choosable = [a for a in self.allowed(bucket) if not (backoff and a == self.none_arm)]
        arms = {kk: self.table((kk, bucket)).choose(price, choosable, w) for kk in keys}
        if plain and (backoff or all(self.table((kk, bucket)).nres[self.none_arm] > 0 for kk in keys)):
            arms = dict.fromkeys(keys, self.none_arm)
        if self.sync is not None:
            arms = self.sync(arms)
        k = ctx.budget(self.k)
        cands = None
        once0 = self._once_total()
        if self.mamba is not None:      # one batched drafter pass for the rows whose arm drafts
            pull = {i: self.shapes[arms[self.key_of(r)]] for i, r in enumerate(ctx.requests) if r.sampled and k}
            pull = {i: s for i, s in pull.items() if s}
            # as wide as any allowed arm (every pulled arm is one): the leaves a narrower pull
            # leaves out still tell, in a greedy step, what the wider arms would have made
            wide = max((max(self.shapes[a]) for a in self.allowed(bucket) if self.shapes[a]), default=1)
            cands = self.mamba.draft_tree(ctx, pull, min(max(map(len, pull.values()), default=0), k), wide)
        out: list = []
        drafted: dict[int, list[int]] = {}
        chains: list[tuple] = []       # (row, request, arm, draft, classes): the chain arms' rows, cut below
        unpulled: list[tuple] = []     # the same for greedy rows whose arm is a tree
        deepest = max((a for a in self.chain_arms if a in self.allowed(bucket)),
                      key=lambda a: len(self.shapes[a]), default=None)
        greedy_batch, shadow_s = all(r.greedy for r in live), 0.0
        for i, req in enumerate(ctx.requests):
            la = self.lookahead
            st = la.states.get(req.req_id)
            if st is None:
                st = la.states[req.req_id] = la.new_state(req)
            if not req.sampled:
                out.append([])
                continue
            kk = self.key_of(req)
            arm = arms[kk]
            shape = self.shapes[arm]
            # The lookahead pool learns from a request's steps only around its drafts: after a step
            # that verified some, or before one that drafts or shadows (`SHADOW_EVERY`). While backed
            # off (large batches) a request costs next to nothing here; its text is indexed when it
            # drafts again (incrementally).
            # Every SHADOW_EVERY-th step of "no speculation" in a greedy batch, the deepest chain arm
            # drafts anyway, unverified: the step's tokens tell what it would have made
            # (`_counterfactual`), so its mean follows the traffic while it is not pulled. Its
            # seconds are no arm's cost. Without it a chain arm's mean stayed what it was when last
            # pulled (chat), and "no speculation" held through prompts that repeat their source.
            shadow = (not shape and k and cands is None and deepest is not None and greedy_batch
                      and self.steps % SHADOW_EVERY == 0)
            t0, once1 = (self.clock(), self._once_total()) if shadow else (0.0, 0.0)
            if cands is None and (req.drafts or (k and shape) or shadow):
                la.observe(st, req)
            if not k:                    # the engine's budget says no drafts: no arm was pulled
                out.append([])
                continue
            self.pending.setdefault((kk, bucket), (arm, []))[1].append(req.req_id)
            if not shape:
                out.append([])
                if shadow:   # what the chain arm would have drafted: `_counterfactual` reads it
                    unpulled.append((i, req, deepest, *la.chain_draft(st, req, min(len(self.shapes[deepest]), k))))
                    self.subsets[req.req_id] = (0, False, {}, {})
                    shadow_s += self.clock() - t0 - (self._once_total() - once1)
                continue
            if arm in self.chain_arms:
                chains.append((i, req, arm, *la.chain_draft(st, req, min(len(shape), k))))
                out.append([])
                continue
            subs: dict[int, frozenset] = {}
            wider: dict[int, list] = {}
            # (a chain arm drafts the chain form, not the tree's best path: not a subset)
            also = {a: self.shapes[a] for a in self.allowed(bucket)
                    if a != arm and self.shapes[a] and a not in self.chain_arms}
            cut = node_price if (self.steps + i) % self.GATE_EXPLORE else 0.0
            if cands is None:
                tree = la.propose_tree(st, req, k, list(shape), also, subs, cut)
                if req.greedy and deepest is not None:   # what a chain arm would have drafted: `greedy_tokens`
                    unpulled.append((i, req, deepest, *la.chain_draft(st, req, min(len(self.shapes[deepest]), k))))
            else:
                toks, pars, score = cands[i]
                # best first, parents first (scores fall along a path): those that pay
                order = [j for j in sorted(range(len(toks)), key=lambda j: (-score[j], j)) if score[j] > cut]
                tree, _ = shaped_tree(order, toks, pars, shape, min(la.tree_nodes, k, sum(shape)), also, subs,
                                      min(la.tree_nodes, k))
                if req.greedy:   # the other arms no deeper than this one: their trees, for `greedy_tokens`
                    for a, sh in also.items():
                        if a not in subs and len(sh) <= len(shape):
                            sel = _select(order, pars, sh, min(la.tree_nodes, k, sum(sh)))
                            wider[a] = [(j, toks[j], pars[j]) for j in sel]
            drafted.setdefault(arm, []).append(len(tree))
            if len(tree):
                self.subsets[req.req_id] = (len(tree), tree.is_chain, subs, wider)
            out.append(tree)
        nodes = sum(map(len, out))
        if unpulled:     # a chain arm's outcome in a greedy step: its chain as the cut would keep it
            # had every row pulled it (no tree nodes in the step)
            keep, reach = self._chain_keep(unpulled, len(live), 0, explore=False)
            for i, req, a, d, cls in unpulled:
                self.sent[req.req_id] = (list(cls), [int(x) for x in d])
                rec = self.subsets.get(req.req_id)
                if rec is not None:
                    rec[3][a] = [(j, d[j], j - 1) for j in range(keep[i])]
                    self.reach[req.req_id] = reach[i][:keep[i]]
        if chains:
            keep, _ = self._chain_keep(chains, len(live), nodes)
            if self.sync is not None:
                keep = self.sync(keep)
            for i, req, arm, d, cls in chains:
                m = keep[i]
                out[i] = d[:m]
                drafted.setdefault(arm, []).append(m)
                if req.greedy:
                    self.sent[req.req_id] = (list(cls[:m + 1]), [int(x) for x in d[:m + 1]])
                elif m:
                    self.sent[req.req_id] = (list(cls[:m]), None)
                if m:
                    # another chain arm would have kept the same tokens, up to its depth (where the
                    # cut, not this arm's depth, ended this chain)
                    subs = {a: frozenset(range(min(len(self.shapes[a]), m))) for a in self.chain_arms
                            if a != arm and (len(self.shapes[a]) <= len(self.shapes[arm]) or m < len(d))}
                    self.subsets[req.req_id] = (m, True, subs, {})
        self.once_s = self._once_total() - once0 + shadow_s
        for arm, v in drafted.items():   # a mean over an arm's first steps, then an EMA
            self.node_steps[arm] = min(self.node_steps[arm] + 1, self.NODE_MEMORY)
            self.nodes[arm] += (sum(v) / len(v) - self.nodes[arm]) / self.node_steps[arm]
            self.drafting[arm] += (float(any(v)) - self.drafting[arm]) / self.node_steps[arm]
        self.steps += 1
        self.last_start = now
        self.draft_seconds += self.clock() - now
        if self.log_every and self.steps % self.log_every == 0:
            logger.info("vllm-spec-plugins bandit_tree: %s", self.describe())
        return out

    def _chain_keep(self, chains: list, n: int, nodes: int, explore: bool = True) -> tuple[dict, dict]:
        """Tokens kept of each chain arm's draft (row -> count), cut as `Goodput._allocate` cuts
        (`price_cut`; a token's chance of acceptance from `accept`'s class rates), the other rows'
        `nodes` tree nodes priced in the step; none where the kept tokens do not cover the step's
        jump. `explore`: every `CHAIN_EXPLORE`-th step one row (in turn) keeps one token more.
        Before any step is measured one row keeps its whole chain (it measures every depth's
        classes at once); without `row_gate`, every chain is kept whole. Also each row's chances
        along its draft (row -> list)."""
        glob = self.accept.global_rate()
        reach = {i: chances(self.accept.rates(req.req_id, glob).tolist(), cls) for i, req, _, _, cls in chains}
        keep = dict.fromkeys(reach, 0)
        fit = self.cost.fit(max(n, 1), self.context)
        if fit is None:
            keep[chains[0][0]] = len(chains[0][3])
            return keep, reach
        if not self.row_gate:
            return {i: len(d) for i, _, _, d, _ in chains}, reach
        made, extra = price_cut([(-p, j, i) for i, ps in reach.items() for j, p in enumerate(ps)],
                                keep, n, fit, nodes)
        extra -= nodes
        if not nodes and not drafting_pays(fit, n, made, extra):
            return dict.fromkeys(keep, 0), reach
        if explore and extra and self.CHAIN_EXPLORE and self.steps % self.CHAIN_EXPLORE == 0:
            rows = [i for i, _, _, d, _ in chains if keep[i] < len(d)]
            if rows:
                keep[rows[(self.steps // self.CHAIN_EXPLORE) % len(rows)]] += 1
        return keep, reach

    def _reward(self, live: list[RequestStep], seconds: float, timing: tuple | None) -> bool:
        """Tokens per request of last step's arms (and of the arms whose outcome is known), and
        the step's measured / predicted seconds for its arm when one arm ran it; the history
        keeps the pulled arm's measured reward, tokens per request / the step's seconds. Returns
        whether the step's time counts (no arm of it was in its warmup)."""
        single = len({arm for arm, _ in self.pending.values()}) == 1
        timed = True
        by_id = {r.req_id: r for r in live}
        for (kk, bucket), (arm, rids) in self.pending.items():
            got: dict[int, list[float]] = {}
            for rid in rids:
                r = by_id.get(rid)
                if r is None:
                    continue
                got.setdefault(arm, []).append(len(r.sampled))
                for a, t in self._counterfactual(r).items():
                    if a != arm:                    # (the pulled arm's tokens are measured)
                        got.setdefault(a, []).append(t)
            if arm not in got:
                continue
            n = len(got[arm])   # side observations only where known for every request
            tokens = {a: sum(v) / len(v) for a, v in got.items() if len(v) == n}
            seconds_x = timing if single and timing is not None else (None, UNIT)   # timed: one arm ran it
            timed &= self.table((kk, bucket)).step(arm, tokens, *seconds_x)
            self.history.append((self.steps, kk, bucket, arm, tokens[arm] / max(seconds, 1e-9)))
        return timed

    def _counterfactual(self, r: RequestStep) -> dict[int, int]:
        """Tokens other arms would have made for request `r` last step: "no speculation" 1; a
        shape whose tree was a subset of the verified tree, its accepted nodes + 1; in a greedy
        step, a Mamba drafter's arm no deeper than the pulled one, from the target tokens the
        step made (`greedy_tokens`: the drafter's trees hang leaves only off its greedy chain, so
        that count never needs a target token the step did not make, and no outcome is skipped)."""
        out = {self.none_arm: 1} if self.none_arm is not None else {}
        rec = self.subsets.get(r.req_id)
        if rec is None or len(r.drafts) != rec[0]:   # nothing drafted, or cut by the scheduler
            return out
        for a, nodes in rec[3].items():
            t = greedy_tokens(nodes, r.sampled)
            if t is None and a in self.chain_arms:
                # a chain arm's chain agrees with every token the step made and goes on: those,
                # the tokens past them it is expected to have had accepted, and one (dropping the
                # outcome would keep exactly its best steps out of its mean)
                reach, n = self.reach.get(r.req_id, ()), len(r.sampled)
                t = n + 1 + (sum(reach[n:]) / reach[n - 1] if len(reach) > n else 0.0)
            if t is not None:
                out[a] = t
        if r.tree_parents is not None:
            acc = set(r.accepted_nodes or ())
        elif rec[1]:                                 # a chain was drafted and verified
            acc = set(range(r.num_accepted))
        else:
            return out
        for a, nodes in rec[2].items():
            out[a] = len(acc & nodes) + 1
        return out

    # ---- inspection ----------------------------------------------------------------------------
    def describe(self) -> str:
        parts = []
        for (kk, bucket), t in sorted(self.tables.items(), key=lambda x: (str(x[0][0]), x[0][1])):
            means = self.rates((kk, bucket))
            best = max((a for a in range(len(means)) if means[a] is not None),
                       key=lambda a: means[a], default=None)
            arms = ", ".join(f"{shape_name(self.shapes[a])}:{t.pulls[a]}x"
                             + (f"@{means[a]:.1f}" if means[a] is not None else "")
                             for a in range(len(self.shapes)) if t.pulls[a])
            parts.append(f"[{kk} batch>={bucket}] best {shape_name(self.shapes[best]) if best is not None else '-'}"
                         f" (tok/s per request @ mean reward): {arms}")
        return "; ".join(parts) or "no steps yet"

    def inspect(self) -> dict:
        """Bandit state for metrics, logs and the benchmark's plots."""
        return {"shapes": [list(s) for s in self.shapes], "steps": self.steps,
                "draft_seconds": self.draft_seconds,
                "cost_a_b_p_c0_c1_e_b2_s": None if self.cost.coef() is None else [float(x) for x in self.cost.coef()],
                "tables": {f"{kk}|{bucket}": {"pulls": t.pulls, "mean_reward": self.rates((kk, bucket))}
                           for (kk, bucket), t in self.tables.items()},
                "history": [list(h) for h in self.history]}
