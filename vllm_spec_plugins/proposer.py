"""The class vLLM's `custom_class` door instantiates in each worker. It turns the runner's state
into a `StepContext` and hands it to the pure proposer from `vllm_spec_plugins.proposers`."""
from __future__ import annotations

import logging
import os
from collections import Counter

from vllm_spec_plugins.config import ADDITIONAL_KEY, TENANT_KEY, from_params
from vllm_spec_plugins.proposers.base import BuildEnv, Proposer, RequestStep, StepContext
from vllm_spec_plugins.scorers.tree import DraftTree
from vllm_spec_plugins.tree_step import eligible_rows

logger = logging.getLogger("vllm_spec_plugins")

# Tests: "PLACE:CALL[,PLACE:CALL...]" raises inside that place's CALL-th call (1-based), e.g.
# "propose:5,attend:40". Places: release, begin, attend, accept, propose.
INJECT_FAULT_ENV = "VLLM_SPEC_PLUGINS_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


class StepFaults:
    """An exception inside a speculative step stays in that step: it is logged (the first of each
    place with its traceback, then every 100th), counted (`plugin_state_summary()["faults"]`), and
    the step's drafts are dropped; the engine keeps serving."""

    def __init__(self, method: str, inject: str | None = None):
        self.method = method
        self.counts: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()
        self._inject: dict[str, set[int]] = {}
        for item in filter(None, (inject if inject is not None else os.environ.get(INJECT_FAULT_ENV, "")).split(",")):
            place, _, call = item.partition(":")
            self._inject.setdefault(place.strip(), set()).add(int(call))

    def enter(self, place: str) -> None:
        """Marks one call of `place`; raises there when a test asked for it."""
        if self._inject:
            self._calls[place] += 1
            if self._calls[place] in self._inject.get(place, ()):
                raise InjectedFault(f"injected fault: {place} call {self._calls[place]}")

    def record(self, place: str, exc: BaseException, req_ids=()) -> None:
        self.counts[place] += 1
        n = self.counts[place]
        if n == 1 or n % 100 == 0:
            logger.warning("vllm-spec-plugins %s: %s failed (%s: %s) for requests %s; this step's drafts "
                           "are dropped and the engine keeps serving (%d such faults so far)",
                           self.method, place, type(exc).__name__, exc, sorted(req_ids)[:8], n,
                           exc_info=exc if n == 1 else None)


def _drafter(model: str, target: str, dtype):
    """The Mamba drafter in folder `model` over the target's embeddings and head, with the C step
    kernel when it builds. Its projections and head are int8 weights with bf16 activations
    (`matmuls_in`), whatever the target's dtype: a drafted token reads a quarter of the float32
    bytes (what it costs on a CPU: docs/drafters.md), and drafts never change what the target
    outputs. A matrix int8 cannot run stays bf16 under a bf16 target, float32 under any other
    (or none given)."""
    import torch

    from vllm_spec_plugins import native
    from vllm_spec_plugins.proposers.mamba import load_drafter, target_embeddings
    fallback = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    d = load_drafter(model, *target_embeddings(target), "int8", fallback)
    d.step_kernel = native.mamba_step()
    return d


def build_proposer(params: dict, max_requests: int = 8, dtype=None) -> Proposer:
    """The proposer of `translate`'s parameters, built by its method's config (`dtype`: the
    target's; a Mamba drafter's matmuls follow it)."""
    cfg = from_params(params)
    target = params.get("target")
    if cfg.needs_target and target is None:
        raise ValueError(f"method {cfg.method!r} needs the target folder (params['target']), set by the config hook")
    env = BuildEnv(vocab_size=params.get("vocab_size"), max_requests=max_requests, target=target,
                   load_drafter=lambda folder: _drafter(folder, target, dtype))
    return cfg.build(env)


def _request_rows(n_rows: int, spec_decode_metadata) -> list[tuple[int, int]]:
    """Row range of each request in the step's logits (= sample_hidden_states): its verified
    drafts + 1, or one row each without speculative metadata."""
    if spec_decode_metadata is None:
        return [(i, i + 1) for i in range(n_rows)]
    from vllm_spec_plugins.tree_step import row_starts
    return [(a, a + n + 1) for a, n in zip(row_starts(spec_decode_metadata), spec_decode_metadata.num_draft_tokens)]


def _first_path(tree) -> list[int]:
    """Node 0, its first child, that child's first child, ... as a chain."""
    out, cur = [], -1
    while True:
        nxt = next((i for i, p in enumerate(tree.parents) if p == cur), None)
        if nxt is None:
            return out
        out.append(tree.tokens[nxt])
        cur = nxt


def _broadcast_from_rank0(obj):
    """Tensor parallel: choices that depend on measured time (bandit arms) must be the same on
    every rank, or ranks would build different trees for the same scheduled tokens."""
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group().broadcast_object(obj, src=0)


class PluginProposer:
    """vLLM-facing adapter. Holds the only private state vLLM cannot page (inside `impl`)."""

    is_vllm_spec_plugin = True

    def __init__(self, vllm_config):
        params = (vllm_config.additional_config or {}).get(ADDITIONAL_KEY)
        if params is None:
            raise ValueError(f"{__name__}.PluginProposer needs additional_config[{ADDITIONAL_KEY!r}]; "
                             "select it with speculative_config={'method': 'lookahead', ...}")
        self.params = params
        self.impl = build_proposer(params, vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.dtype)
        self.needs_target_argmax = self.impl.needs_target_argmax
        self.max_model_len = vllm_config.model_config.max_model_len
        self._argmax: list[list[int]] | None = None
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            self.impl.set_sync(_broadcast_from_rank0)
        self.trees: dict = {}     # req_id -> DraftTree proposed last step (verified next step)
        self.step = None          # tree_step.TreeStep of the step being verified, from `begin` to `propose`
        self.faults = StepFaults(params["method"])
        if from_params(params).uses_trees:   # build the tree-attention kernel now, not inside a serving step
            from vllm_spec_plugins import native
            native.library()
        self._reset: set[str] = set()   # requests whose proposer state a fault left unknown
        logger.info("vllm-spec-plugins: %s proposer with %s", params["method"], params)

    def load_model(self, *args, **kwargs) -> None:  # model-free proposers load nothing
        pass

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-spec-plugins' runner hook is not installed in this process: "
                           "is the plugin loaded (VLLM_PLUGINS must include 'vllm_spec_plugins')?")

    def release(self, req_ids: set[str]) -> None:
        """Requests that finished, were aborted or preempted (from the `_update_states` wrapper),
        or whose state a fault left unknown (they start over, as after preemption)."""
        for rid in req_ids:
            self.trees.pop(rid, None)
            self._reset.discard(rid)
            try:
                self.faults.enter("release")
                self.impl.release(rid)
            except Exception as e:  # noqa: BLE001 - a leak of one request's state, not the engine
                self.faults.record("release", e, [rid])

    def fault(self, place: str, exc: BaseException, req_ids) -> None:
        """A step failed at `place` (tree preparation, attention, acceptance) for these requests:
        count it; they draft nothing this step and their proposer state starts over from their
        tokens, as after a preemption."""
        req_ids = set(req_ids)
        self.faults.record(place, exc, req_ids)
        self._reset |= req_ids
        for rid in req_ids:
            self.trees.pop(rid, None)

    def propose_safely(self, runner, scheduler_output, sampled_token_ids, *args) -> list[list[int]]:
        """`propose_for_runner`, or no drafts for this step when it raises."""
        skip = set(self._reset)
        try:
            self.release(skip)
            return self.propose_for_runner(runner, scheduler_output, sampled_token_ids, *args, skip=skip)
        except Exception as e:  # noqa: BLE001 - drop this step's drafts, keep serving
            self.step = None
            self._argmax = None
            rids = list(runner.input_batch.req_ids)
            self.faults.record("propose", e, rids)
            self.release(set(rids))
            return [[] for _ in rids]

    # Called from the `_sample` wrapper, before sampling: one argmax per verified position. A step
    # that verified no drafts needs none: a greedy row's argmax is the token it samples (set in
    # `propose_for_runner`), which saves an argmax over the whole batch's logits.
    def record_target_argmax(self, logits, spec_decode_metadata) -> None:
        if spec_decode_metadata is None:
            self._argmax = None
            return
        from vllm_spec_plugins.scorers import row_argmax
        try:
            ids = row_argmax(logits).tolist()
            self._argmax = [ids[a:b] for a, b in _request_rows(len(ids), spec_decode_metadata)]
        except Exception as e:  # noqa: BLE001 - acceptance then takes the argmax from the logits
            self._argmax = None
            self.faults.record("argmax", e)

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids, sample_hidden_states=None,
                           spec_decode_metadata=None, skip=frozenset()) -> list[list[int]]:
        """Drafts per batch row; none for the rows in `skip` (their state was just reset)."""
        from vllm_spec_plugins import tree_step
        batch = runner.input_batch
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        argmax, self._argmax = self._argmax, None
        verified_trees, self.step = tree_step.verdict(self.step), None
        hidden = None
        if self.impl.needs_hidden_states and sample_hidden_states is not None:
            hidden = [sample_hidden_states[a:b] for a, b in
                      _request_rows(sample_hidden_states.shape[0], spec_decode_metadata)]
        reqs, rows, left = [], [], {}
        exact = eligible_rows(runner)
        for i, rid in enumerate(batch.req_ids):
            if rid in skip:
                continue
            rows.append(i)
            n = int(batch.num_tokens_no_spec[i])
            drafts = [t for t in scheduled.get(rid, ()) if t >= 0]
            sampled = list(sampled_token_ids[i])
            eligible = exact[i]
            if argmax is not None:
                am = argmax[i] if i < len(argmax) else None
            elif self.needs_target_argmax and not drafts and eligible and len(sampled) == 1 \
                    and float(batch.temperature_cpu[i]) < 1e-5:
                am = sampled            # greedy, nothing verified: the target's argmax is what it sampled
            else:
                am = None
            parents, accepted = verified_trees.get(i, (None, None))
            state = runner.requests.get(rid)
            sp = getattr(state, "sampling_params", None)
            # the tokens this request may still make: drafts beyond them would only be discarded
            left[rid] = (sp.max_tokens - len(state.output_token_ids)
                         if getattr(sp, "max_tokens", None) is not None else None)
            reqs.append(RequestStep(rid, batch.token_ids_cpu[i, :n], sampled,
                                    drafts, am, parents, accepted, eligible,
                                    getattr(sp, "extra_args", None),
                                    hidden[i] if hidden is not None and i < len(hidden) else None,
                                    float(batch.temperature_cpu[i]) < 1e-5,
                                    (getattr(sp, "extra_args", None) or {}).get(TENANT_KEY)))
        # vLLM's per-step budget (its dynamic speculative decoding schedule, else k). Requests
        # that left were released once already, by this step's `_update_states` hook (`release`).
        ctx = StepContext(reqs, set(), set(), getattr(scheduler_output, "num_spec_tokens_to_schedule", None),
                          scheduler_output.total_num_scheduled_tokens)
        drafts = self.impl.propose(ctx)
        self.faults.enter("propose")       # after the proposer's state moved on: the harder case
        out = [[] for _ in batch.req_ids]
        for i, req, d in zip(rows, reqs, drafts):
            room = max(self.max_model_len - len(req.token_ids) - 1, 0)   # never past max_model_len
            if left[req.req_id] is not None:     # nor past max_tokens (a step makes drafts + 1)
                room = min(room, max(left[req.req_id] - 1, 0))
            if not req.tree_ok:
                # logprobs, penalties, bias, bad words, allowed ids, min_p, min_tokens, a grammar,
                # or batch-wide a thinking budget or a user's argmax-moving logits processor
                # (`eligible_rows`): our acceptance verifies the target's logits under temperature
                # and top-k/top-p only; exactness first: no drafts for this request.
                room = 0
            if isinstance(d, DraftTree):
                if not req.tree_ok:
                    d = _first_path(d)
                else:
                    d = tree_step.truncate(d, room)
                    self.trees[req.req_id] = d
                    out[i] = list(d.tokens)
                    continue
            self.trees.pop(req.req_id, None)
            out[i] = list(d[:room])
        return out


def _impl(worker) -> Proposer | None:
    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.impl if isinstance(drafter, PluginProposer) else None


def plugin_state_summary(worker) -> dict:
    """For `LLM.collective_rpc`: per-request state held by our proposer in this worker."""
    impl = _impl(worker)
    if impl is None:
        return {"method": None, "requests": 0, "nbytes": 0}
    ids = impl.request_ids()
    out = {"method": worker.model_runner.drafter.params["method"], "requests": len(ids),
           "nbytes": sum(impl.state_nbytes(r) for r in ids), "req_ids": sorted(ids), **impl.summary()}
    if impl.counters():
        out["stats"] = impl.counters()
    out["faults"] = dict(worker.model_runner.drafter.faults.counts)
    return out


def plugin_stats(worker) -> dict:
    """For `LLM.collective_rpc`: the proposer's cumulative counters (cascade: per level), or {}."""
    impl = _impl(worker)
    return {} if impl is None else {k: list(v) if isinstance(v, list) else v for k, v in impl.counters().items()}


def plugin_goodput(worker) -> dict | None:
    """For `LLM.collective_rpc`: goodput's cost fit, rates and counters (`Goodput.goodput_state`),
    or None when the proposer has no goodput."""
    impl = _impl(worker)
    state = getattr(impl, "goodput_state", None)
    return None if state is None else state()


def plugin_steps(worker) -> int:
    """For `LLM.collective_rpc`: steps our proposer has taken in this worker (0 if none)."""
    impl = _impl(worker)
    return 0 if impl is None else impl.steps


class StateReport:
    """`--worker-extension-cls vllm_spec_plugins.proposer.StateReport`: each worker answers
    `collective_rpc("plugin_state_summary")` (over HTTP: POST /collective_rpc with
    VLLM_SERVER_DEV_MODE=1), so a load test can check that per-request state is freed."""

    def plugin_state_summary(self) -> dict:
        return plugin_state_summary(self)
