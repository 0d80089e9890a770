"""An all-greedy step's verdict read off one argmax (`tree_step.greedy_sample`) is vLLM's rejection
sampler's, token for token, and only steps whose every row that sampler treats as plain argmax
take it (`tree_step.greedy_batch`)."""
from types import SimpleNamespace

import pytest
import torch

from vllm_spec_plugins import tree_step
from vllm_spec_plugins.scorers import greedy_chain


def test_greedy_chain_is_the_accepted_prefix_then_the_argmax():
    assert greedy_chain([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert greedy_chain([5, 6], [5, 6, 8]) == [5, 6, 8]
    assert greedy_chain([5], [1, 2]) == [1]
    assert greedy_chain([], [3]) == [3]
    with pytest.raises(ValueError):
        greedy_chain([1, 2], [1, 2])


def _greedy_metadata(n: int, logitsprocs=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=logitsprocs if logitsprocs is not None else LogitsProcessors())


def _spec_metadata(drafts: list[list[int]]):
    """vLLM's spec-decode metadata for one step verifying `drafts`: request i's logits rows are its
    drafts' target rows, then its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    counts = [len(d) for d in drafts]
    starts = [sum(counts[:i]) + i for i in range(len(counts))]
    i32 = {"dtype": torch.int32}
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], **i32), num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts, **i32).cumsum(0, **i32),
        cu_num_sampled_tokens=torch.tensor([n + 1 for n in counts], **i32).cumsum(0, **i32),
        target_logits_indices=torch.tensor([s + j for s, n in zip(starts, counts) for j in range(n)], **i32),
        bonus_logits_indices=torch.tensor([s + n for s, n in zip(starts, counts)], **i32),
        logits_indices=torch.arange(sum(counts) + len(counts), **i32))


def _compare_with_vllm(dtype_name: str) -> None:
    """In a process of its own: vLLM's CPU kernels registered as an engine registers them (twice
    in one process they break the next engine)."""
    from vllm.platforms import current_platform

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    dtype = getattr(torch, dtype_name)
    rs = RejectionSampler(Sampler())
    runner = SimpleNamespace(input_batch=SimpleNamespace(update_async_output_token_ids=lambda: None))
    g = torch.Generator().manual_seed(0)
    vocab = 300
    for _ in range(60):
        b = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 6, (b,), generator=g).tolist()
        if not any(counts):
            counts[0] = 1
        logits = torch.randint(-4, 4, (sum(counts) + b, vocab), generator=g).to(dtype)   # ties
        argmax = logits.float().argmax(-1).tolist()
        drafts, pos = [], 0
        for n in counts:
            row = []
            for j in range(n):     # the argmax (accepted) at first, then more and more often not
                hit = float(torch.rand(1, generator=g)) < 0.8 - 0.15 * j
                row.append(argmax[pos + j] if hit else int(torch.randint(0, vocab, (1,), generator=g)))
            drafts.append(row)
            pos += n + 1
        md = _spec_metadata(drafts)
        want = rs(md, None, logits.clone(), _greedy_metadata(b)).sampled_token_ids
        per_request = [argmax[a:a + n + 1] for a, n in zip(tree_step.row_starts(md), counts)]
        got = tree_step.greedy_sample(runner, md, per_request).sampled_token_ids
        assert got.dtype == want.dtype and torch.equal(got, want), (counts, drafts, got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_sample_equals_vllms_rejection_sampler(dtype):
    """Random batches (rows without drafts among them, drafts that follow the argmax for a while,
    coarse logits full of ties): the same output tensor as vLLM's sampler."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_compare_with_vllm, dtype).result()


def _runner(n: int, **change):
    """A fake runner whose n rows are greedy requests our acceptance serves; `change` edits it."""
    reqs = {f"r{i}": SimpleNamespace(sampling_params=SimpleNamespace(
        structured_outputs=None, min_p=0.0, logit_bias=None, prompt_logprobs=None, min_tokens=0))
        for i in range(n)}
    batch = SimpleNamespace(req_ids=list(reqs), num_logprobs={}, frequency_penalties_reqs=set(),
                            presence_penalties_reqs=set(), repetition_penalties_reqs=set(),
                            has_allowed_token_ids=set(), bad_words_token_ids={},
                            sampling_metadata=_greedy_metadata(n))
    runner = SimpleNamespace(input_batch=batch, requests=reqs)
    for path, value in change.items():
        *owner, name = path.split("__")
        obj = runner
        for part in owner:
            obj = getattr(obj, part) if not isinstance(obj, dict) else obj[part]
        setattr(obj, name, value)
    return runner


def test_greedy_batch_admits_only_steps_vllms_sampler_would_argmax():
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    logits = torch.zeros(3, 10)
    assert tree_step.greedy_batch(_runner(3), logits)
    assert not tree_step.greedy_batch(_runner(3), logits.to("meta"))       # not the CPU
    md = _greedy_metadata(3)
    for field, value in (("all_greedy", False), ("max_num_logprobs", 0), ("no_penalties", False),
                         ("allowed_token_ids_mask", torch.zeros(3, 10, dtype=torch.bool)),
                         ("bad_words_token_ids", {1: [[4]]}),
                         ("thinking_budget_state_holder", SimpleNamespace(has_tracked_requests=lambda: True))):
        assert not tree_step.greedy_batch(_runner(3, input_batch__sampling_metadata=replace(md, **{field: value})),
                                          logits), field
    idle = SimpleNamespace(has_tracked_requests=lambda: False)
    assert tree_step.greedy_batch(_runner(3, input_batch__sampling_metadata=replace(
        md, thinking_budget_state_holder=idle)), logits)

    class Custom:   # a user's processor that may move the argmax
        def is_argmax_invariant(self):
            return False
    custom = replace(md, logitsprocs=LogitsProcessors([Custom()]))
    assert not tree_step.greedy_batch(_runner(3, input_batch__sampling_metadata=custom), logits)
    # those two hold for every request of the batch our acceptance would serve, trees and sampling
    # included: vLLM applies a thinking budget inside its rejection sampler, ours would not
    busy = replace(md, thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True))
    for changed in (custom, busy):
        assert not any(tree_step.eligible_rows(_runner(3, input_batch__sampling_metadata=changed)))
    assert all(tree_step.eligible_rows(_runner(3)))
    # one request with min_tokens (vLLM masks its stop tokens), or logprobs: not ours to argmax
    assert not tree_step.greedy_batch(_runner(3, requests__r1__sampling_params__min_tokens=4), logits)
    assert not tree_step.greedy_batch(_runner(3, input_batch__num_logprobs={"r2": 1}), logits)
