"""vllm-spec-plugins: speculative decoders for vLLM (entry point `vllm.general_plugins`)."""
from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Runs in every vLLM process (API server, engine core, workers). Idempotent."""
    global _registered
    if _registered:
        return
    from vllm_spec_plugins import _compat
    _compat.check_version()
    _compat.apply_patches()
    _registered = True
