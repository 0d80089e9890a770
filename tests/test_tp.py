"""Tensor parallel 2 over `mp` on this CPU, each of our methods: the parameters reach both workers,
both ranks build the same drafts (bandit_tree: rank 0's arm choices, node price and chain cuts are
broadcast, since they depend on measured time), and the output equals plain vLLM's. On the tiny test
model: SmolLM2-135M's 9 attention heads do not split over 2 ranks."""
import os
import shutil
import tempfile

import pytest

from vllm_spec_plugins.tools.runner import run_isolated

# VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc(plugin_state_summary) sends a function to the
# worker processes, which vLLM's msgpack transport only pickles when allowed (local test only).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
          "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
SPECS = {
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 5, "ngram": 3, "guesses": 5,
                  "goodput": False},
    # goodput (on by default) rightly stops drafting on the random tiny model, whose step is
    # dominated by the speculation jump: the check is that both ranks made the same choices.
    "lookahead_goodput": {"method": "lookahead", "num_speculative_tokens": 5, "ngram": 3, "guesses": 5},
    "lookahead_tree": {"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "tree": True},
    "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0},
}


@pytest.fixture(scope="module")
def private_tmp():
    """vLLM's mp executor leaves zmq sockets and dist files under VLLM_RPC_BASE_PATH / TMPDIR:
    point them at a private folder, remove it, and check nothing else appeared in /tmp."""
    skip = ("pytest-of-", "bash_jobs")
    before = {n for n in os.listdir("/tmp") if not n.startswith(skip)}
    tmp = tempfile.mkdtemp(prefix="tpvsp", dir="/tmp")
    yield {"VLLM_RPC_BASE_PATH": tmp, "TMPDIR": tmp}
    shutil.rmtree(tmp, ignore_errors=True)
    new = {n for n in os.listdir("/tmp") if not n.startswith(skip)} - before
    assert not new, f"files left in /tmp: {sorted(new)[:10]}"


@pytest.fixture(scope="module")
def base(tiny_model, heldout_prompts):
    return {"model": tiny_model, "groups": {"all": heldout_prompts[:4]}, "max_tokens": 24,
            "dtype": "float32", "batch_size": 4, "llm_kwargs": {"enforce_eager": True}}


@pytest.fixture(scope="module")
def plain(base):
    return run_isolated(base)["groups"]["all"]


@pytest.mark.slow
# CI: a chain drafting every step and a tree whose arms rank 0 broadcasts; extended: the rest.
@pytest.mark.parametrize("name", [
    n if n in ("lookahead", "bandit_tree") else pytest.param(n, marks=pytest.mark.extended) for n in SPECS])
def test_tp2_identical_to_plain(name, base, plain, private_tmp):
    tp = {**base, "llm_kwargs": {"enforce_eager": True, "tensor_parallel_size": 2,
                                 "distributed_executor_backend": "mp"},
          "speculative_config": SPECS[name], "report_plugin_state": True}
    res = run_isolated(tp, env={**TP_ENV, **private_tmp})
    got = res["groups"]["all"]
    assert got["outputs"] == plain["outputs"]
    if name != "lookahead_goodput":
        assert got["drafts"] > 0
    workers = res["plugin_state"]
    method = SPECS[name]["method"]
    assert len(workers) == 2 and all(w["method"] == method for w in workers), workers
    if name == "lookahead_goodput":   # rank 0's on/off choices and cuts, over real drafts, on both ranks
        stats = [[w["goodput"][k] for k in ("drafting_steps", "probes", "drafted", "kept")] for w in workers]
        assert stats[0] == stats[1], stats
        assert workers[0]["goodput"]["steps"] > 0 and workers[0]["goodput"]["drafted"] > 0, workers[0]["goodput"]
    if method == "bandit_tree":   # the same arms were pulled on both ranks
        pulls = [{k: t["pulls"] for k, t in w["bandit"]["tables"].items()} for w in workers]
        assert pulls[0] == pulls[1] and pulls[0], pulls
