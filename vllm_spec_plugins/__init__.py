"""vllm-spec-plugins: speculative decoders for vLLM (entry point `vllm.general_plugins`)."""
from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Runs in every vLLM process (API server, engine core, workers). Idempotent, and never raises:
    on a vLLM it cannot hook it patches nothing and logs one warning (`_compat.install`)."""
    global _registered
    if _registered:
        return
    _registered = True
    import os

    from vllm_spec_plugins import _compat
    from vllm_spec_plugins.proposers.testing import TEST_METHODS_ENV
    if os.environ.get(TEST_METHODS_ENV):      # the tests' and the benchmark's timing methods
        from vllm_spec_plugins.proposers import testing
        testing.register()
    _compat.install()
