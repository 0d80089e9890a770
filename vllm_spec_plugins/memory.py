"""A KV-cache size for vLLM's CPU backend that fits the memory its worker will find.

Without `VLLM_CPU_KVCACHE_SPACE` (or `--kv-cache-memory-bytes`), vLLM's CPU worker reserves
`gpu_memory_utilization` (0.92) of its NUMA node's *total* memory and refuses to start when the
node has less than that *available*: on a machine whose node 0 reports ~7.5 GiB, once the API
server and engine core hold ~1.5 GiB, plain `vllm serve` fails its start-up check. An explicit
KV-cache size skips that check, so we choose one from the memory vLLM itself reports.

`vllm-spec serve` applies it when the user chose nothing; offline users call it themselves:

    LLM(model, kv_cache_memory_bytes=vllm_spec_plugins.memory.fit_kv_cache_bytes(model), ...)
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("vllm_spec_plugins")

GiB = 1 << 30
ENV = "VLLM_CPU_KVCACHE_SPACE"
# What the API server, the engine core and the worker hold besides the weights (measured ~1.5 GiB
# for the first two with SmolLM2-135M), with headroom for activations and the compile cache.
PROCESS_OVERHEAD = 2 * GiB
SHARE = 0.5          # of what is left: the rest stays free for the OS and other processes


def weights_bytes(model: str | None) -> int:
    """Bytes of a local model folder's weight files (0 when unknown: a hub id, no folder)."""
    if not model or not os.path.isdir(model):
        return 0
    return sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
               if f.endswith((".safetensors", ".bin", ".pt", ".gguf")))


def node_memory(node: int = 0) -> tuple[int, int]:
    """(total, available) bytes of a NUMA node, as vLLM's CPU worker computes them."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info
    info = get_memory_node_info(node)
    return info.total_memory, info.available_memory


def fit_kv_cache_gib(available: int, weights: int = 0) -> int:
    """Whole GiB (what VLLM_CPU_KVCACHE_SPACE takes) of KV cache for `available` bytes on the node:
    half of what the processes and the weights (loaded once, plus a conversion copy) leave; at
    least 1."""
    left = available - PROCESS_OVERHEAD - 2 * weights
    return max(1, int(left * SHARE // GiB))


def fit_kv_cache_bytes(model: str | None = None, node: int = 0) -> int:
    _, available = node_memory(node)
    return fit_kv_cache_gib(available, weights_bytes(model)) * GiB


def choose_for_serve(argv: list[str], model: str | None, env=os.environ) -> int | None:
    """`vllm-spec serve` on the CPU backend with no KV-cache size chosen: set VLLM_CPU_KVCACHE_SPACE
    (inherited by the engine core and workers) and say so. Returns the GiB chosen, else None."""
    chosen_flags = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--kv-cache-memory")
    if env.get(ENV) or any(a.split("=", 1)[0] in chosen_flags for a in argv):
        return None
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return None
        total, available = node_memory()
    except Exception as e:  # noqa: BLE001 - sizing is a convenience: leave vLLM's default
        logger.warning("vllm-spec: could not read the memory node (%s); vLLM sizes the KV cache", e)
        return None
    gib = fit_kv_cache_gib(available, weights_bytes(model))
    env[ENV] = str(gib)
    msg = (f"vllm-spec: {ENV} not set; node 0 has {available / GiB:.1f} of {total / GiB:.1f} GiB "
           f"available, so the KV cache gets {gib} GiB (set {ENV} or --kv-cache-memory-bytes to choose)")
    print(msg, file=sys.stderr, flush=True)
    return gib
