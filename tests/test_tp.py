"""Tensor parallel 2 over `mp` on this CPU: our parameters reach both workers (each runs the
proposer on identical inputs and drafts the same tokens) and output equals plain vLLM."""
import pytest

from vllm_spec_plugins.runner import run_isolated

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


@pytest.mark.slow
def test_lookahead_tp2_identical_to_plain(default_model, heldout_prompts):
    prompts = heldout_prompts[:4]
    base = {"model": default_model, "groups": {"all": prompts}, "max_tokens": 24, "dtype": "float32",
            "batch_size": 4, "llm_kwargs": {"enforce_eager": True}}
    plain = run_isolated(base)["groups"]["all"]
    tp = {**base, "llm_kwargs": {"enforce_eager": True, "tensor_parallel_size": 2,
                                 "distributed_executor_backend": "mp"},
          "speculative_config": {"method": "lookahead", "num_speculative_tokens": 5, "ngram": 3,
                                 "guesses": 5},
          "report_plugin_state": True}
    res = run_isolated(tp, env=TP_ENV)
    got = res["groups"]["all"]
    assert got["outputs"] == plain["outputs"]
    assert got["drafts"] > 0
    workers = res["plugin_state"]
    assert len(workers) == 2 and all(w["method"] == "lookahead" for w in workers), workers
