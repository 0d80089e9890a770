"""Tree rows re-attended with their tree mask after vLLM's CPU attention (`tree_step.attend`)."""
from __future__ import annotations

import functools

SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.attention.backends.cpu_attn": {
        "CPUAttentionBackendImpl.forward": ("self", "layer", "query", "key", "value", "kv_cache",
                                            "attn_metadata", "output"),
        "CPUAttentionBackendImpl.scale": (), "CPUAttentionBackendImpl.sliding_window": (),
        "CPUAttentionBackendImpl.logits_soft_cap": (), "CPUAttentionBackendImpl.sinks": (),
        "_get_attn_isa": ("dtype", "block_size", "head_size"),
    },
}


def apply(set_) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_spec_plugins import tree_step

    orig_forward = CPUAttentionBackendImpl.forward

    @functools.wraps(orig_forward)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        owner = tree_step.owner_of(layer)
        step = owner.step if owner is not None else None
        if attn_metadata is not None and step is not None and not step.failed:
            try:
                step.owner.faults.enter("attend")
                tree_step.attend(step, self, layer, query, kv_cache, attn_metadata, output)
            except Exception as e:  # noqa: BLE001 - its tree rows then accept no drafts
                step.failed = True
                step.owner.fault("attend", e, step.req_ids.values())
        return out

    set_(CPUAttentionBackendImpl, "forward", forward)
