"""The class vLLM's `custom_class` door instantiates in each worker. It turns the runner's state
into a `StepContext` and hands it to the pure proposer from `vllm_spec_plugins.proposers`."""
from __future__ import annotations

import logging

import numpy as np

from vllm_spec_plugins.config import ADDITIONAL_KEY
from vllm_spec_plugins.proposers.base import Proposer, RequestStep, StepContext

logger = logging.getLogger("vllm_spec_plugins")


def build_proposer(params: dict) -> Proposer:
    p = dict(params)
    method = p.pop("method")
    k = p.pop("num_speculative_tokens")
    vocab = p.pop("vocab_size", None)
    if method == "lookahead":
        from vllm_spec_plugins.proposers.lookahead import LookaheadProposer
        return LookaheadProposer(k, vocab_size=vocab, **p)
    if method in ("oracle", "adversarial"):
        from vllm_spec_plugins.proposers import testing
        refs = testing.load_references(p["references"])
        cls = testing.OracleProposer if method == "oracle" else testing.AdversarialProposer
        return cls(k, references=refs) if method == "oracle" else cls(k, references=refs, vocab_size=vocab)
    raise ValueError(f"unknown vllm-spec-plugins method {method!r}")


class PluginProposer:
    """vLLM-facing adapter. Holds the only private state vLLM cannot page (inside `impl`)."""

    is_vllm_spec_plugin = True

    def __init__(self, vllm_config):
        params = (vllm_config.additional_config or {}).get(ADDITIONAL_KEY)
        if params is None:
            raise ValueError(f"{__name__}.PluginProposer needs additional_config[{ADDITIONAL_KEY!r}]; "
                             "select it with speculative_config={'method': 'lookahead', ...}")
        self.params = params
        self.impl = build_proposer(params)
        self.needs_target_argmax = self.impl.needs_target_argmax
        self.max_model_len = vllm_config.model_config.max_model_len
        self._argmax: list[list[int]] | None = None
        logger.info("vllm-spec-plugins: %s proposer with %s", params["method"], params)

    def load_model(self, *args, **kwargs) -> None:  # model-free proposers load nothing
        pass

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-spec-plugins' runner hook is not installed in this process: "
                           "is the plugin loaded (VLLM_PLUGINS must include 'vllm_spec_plugins')?")

    # Called from the `_sample` wrapper, before sampling: one argmax per verified position.
    def record_target_argmax(self, logits, spec_decode_metadata) -> None:
        ids = logits.argmax(dim=-1).tolist()
        if spec_decode_metadata is None:
            self._argmax = [[t] for t in ids]
            return
        out, pos = [], 0
        for n in spec_decode_metadata.num_draft_tokens:
            out.append(ids[pos: pos + n + 1])
            pos += n + 1
        self._argmax = out

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids) -> list[list[int]]:
        batch = runner.input_batch
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        argmax, self._argmax = self._argmax, None
        reqs = []
        for i, rid in enumerate(batch.req_ids):
            n = int(batch.num_tokens_no_spec[i])
            drafts = [t for t in scheduled.get(rid, ()) if t >= 0]
            am = argmax[i] if argmax is not None and i < len(argmax) else None
            reqs.append(RequestStep(rid, batch.token_ids_cpu[i, :n], list(sampled_token_ids[i]),
                                    drafts, am))
        ctx = StepContext(reqs, set(scheduler_output.finished_req_ids),
                          set(scheduler_output.preempted_req_ids or ()), self.impl.k)
        drafts = self.impl.propose(ctx)
        for i, req in enumerate(reqs):   # never draft past max_model_len
            room = self.max_model_len - len(req.token_ids) - 1
            if len(drafts[i]) > room:
                drafts[i] = drafts[i][: max(room, 0)]
        return drafts


def plugin_state_summary(worker) -> dict:
    """For `LLM.collective_rpc`: per-request state held by our proposer in this worker."""
    drafter = getattr(worker.model_runner, "drafter", None)
    impl = getattr(drafter, "impl", None)
    if impl is None:
        return {"method": None, "requests": 0, "nbytes": 0}
    nbytes = sum(impl.state_nbytes(r) for r in impl.states) if hasattr(impl, "state_nbytes") else None
    return {"method": drafter.params["method"], "requests": len(impl.states), "nbytes": nbytes,
            "req_ids": sorted(impl.states)}
