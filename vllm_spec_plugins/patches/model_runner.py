"""The runner's step: our proposer sees every step (`StepContext`), tree rows get depth positions
and masks, acceptance runs after vLLM's sampler, and requests that leave are released once.
`GPUModelRunner` methods, which vLLM's CPU runner inherits."""
from __future__ import annotations

import functools

SYMBOLS: dict[str, dict[str, tuple[str, ...]]] = {
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
        "GPUModelRunner.compilation_config": (),
    },
    "vllm.v1.worker.gpu_input_batch": {
        "InputBatch.num_computed_tokens_cpu": (), "InputBatch.temperature_cpu": (),
        "InputBatch.generators": (), "InputBatch.num_logprobs": (), "InputBatch.sampling_metadata": (),
        "InputBatch.bad_words_token_ids": (),
        "InputBatch.token_ids_cpu": (), "InputBatch.num_tokens_no_spec": (),
        "InputBatch.req_ids": (), "InputBatch.num_reqs": (),
        "InputBatch.frequency_penalties_reqs": (), "InputBatch.presence_penalties_reqs": (),
        "InputBatch.repetition_penalties_reqs": (), "InputBatch.has_allowed_token_ids": (),
        "InputBatch.update_async_output_token_ids": ("self",),
    },
    "vllm.v1.spec_decode.metadata": {
        "SpecDecodeMetadata.num_draft_tokens": (), "SpecDecodeMetadata.draft_token_ids": (),
    },
    # an all-greedy step's verdict without vLLM's rejection sampler (`tree_step.greedy_sample`)
    "vllm.v1.outputs": {
        "SamplerOutput": (),
    },
    "vllm.v1.sample.metadata": {
        "SamplingMetadata.all_greedy": (), "SamplingMetadata.max_num_logprobs": (),
        "SamplingMetadata.no_penalties": (), "SamplingMetadata.allowed_token_ids_mask": (),
        "SamplingMetadata.bad_words_token_ids": (), "SamplingMetadata.logitsprocs": (),
        "SamplingMetadata.thinking_budget_state_holder": (),
    },
    "vllm.v1.sample.logits_processor.builtin": {
        "LogitBiasLogitsProcessor": (), "MinTokensLogitsProcessor": (),
    },
    "vllm.v1.sample.logits_processor.state": {
        "LogitsProcessors.non_argmax_invariant": (),
    },
    "vllm.v1.sample.thinking_budget_state": {
        "ThinkingBudgetStateHolder.has_tracked_requests": ("self",),
    },
    "vllm.v1.sample.sampler": {
        "Sampler.topk_topp_sampler": (),
    },
    "vllm.v1.sample.ops.topk_topp_sampler": {
        "TopKTopPSampler.forward_native": ("self", "logits", "generators", "k", "p"),
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
    "vllm.v1.core.sched.scheduler": {
        "Scheduler.max_num_active_reqs": (),
    },
}


def apply(set_) -> None:
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
            drafter.step = None
            try:
                drafter.faults.enter("begin")
                drafter.step = tree_step.begin(self, scheduler_output, drafter)   # depth positions, masks
            except Exception as e:  # noqa: BLE001 - vLLM verifies the drafts as chains (exact)
                drafter.fault("begin", e, scheduler_output.scheduled_spec_decode_tokens)
        return out

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata):
        drafter = getattr(self, "drafter", None)
        if (spec_decode_metadata is not None and getattr(drafter, "is_vllm_spec_plugin", False)
                and not any(spec_decode_metadata.num_draft_tokens)):
            # vLLM 0.32 builds spec-decode metadata for every step once a speculator is configured,
            # so a step with no drafts at all (our proposers back off) would still go through the
            # rejection sampler. Its rows are plain decodes: vLLM's own sampler, exactly as
            # without speculation (a step that drafts nothing costs what a plain step costs).
            spec_decode_metadata = None
        if logits is not None and getattr(drafter, "needs_target_argmax", False):
            # Target argmax at every verified position, before the sampler touches the logits.
            drafter.record_target_argmax(logits, spec_decode_metadata)
        step = getattr(drafter, "step", None)
        if step is not None and not step.failed:
            try:
                tree_step.save_generators(step, self)
            except Exception as e:  # noqa: BLE001
                step.failed = True
                drafter.fault("accept", e, step.req_ids.values())
        out = None
        if (spec_decode_metadata is not None and logits is not None
                and getattr(drafter, "is_vllm_spec_plugin", False)):
            try:   # an all-greedy step: the chains' verdict off one argmax, not vLLM's sampler's ~1 ms
                if tree_step.greedy_batch(self, logits):
                    if drafter._argmax is None:
                        drafter.record_target_argmax(logits, spec_decode_metadata)
                    if drafter._argmax is not None:     # else it failed (recorded): vLLM's sampler
                        out = tree_step.greedy_sample(self, spec_decode_metadata, drafter._argmax)
            except Exception as e:  # noqa: BLE001 - vLLM's rejection sampler decides instead
                drafter.faults.record("greedy_sample", e)
        if out is None:
            out = orig_sample(self, logits, spec_decode_metadata)
        if step is not None and spec_decode_metadata is not None:
            try:
                if step.failed:
                    tree_step.accept_root_only(step, self, logits, spec_decode_metadata, out)
                else:
                    drafter.faults.enter("accept")
                    tree_step.accept(step, self, logits, spec_decode_metadata, out, getattr(drafter, "_argmax", None))
            except Exception as e:  # noqa: BLE001 - no drafts accepted, one token drawn as plain
                drafter.fault("accept", e, step.req_ids.values())
                tree_step.accept_root_only(step, self, logits, spec_decode_metadata, out)
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

    set_(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    set_(GPUModelRunner, "_update_states", _update_states)
    set_(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)
    set_(GPUModelRunner, "_sample", _sample)
    set_(GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids)
