"""Each request's tenant (a digest of its `cache_salt`) carried to the worker."""
from __future__ import annotations

import functools

SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.request": {
        "Request.__init__": ("self",), "Request.cache_salt": (), "Request.sampling_params": (),
    },
}


def tenant_of(salt: str | None) -> str | None:
    import hashlib
    return hashlib.sha256(salt.encode()).hexdigest()[:16] if salt else None


def apply(set_) -> None:
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

    set_(Request, "__init__", __init__)
