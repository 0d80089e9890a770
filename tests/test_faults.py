"""A fault inside a speculative step stays in that step: an exception injected on a chosen call of
each place (drafting, tree preparation, tree attention, acceptance) is counted, that step's drafts
are dropped, the engine keeps serving, and every request's greedy output still equals plain vLLM's
(float32), the faulted requests' included."""
import pytest

from vllm_spec_plugins.proposer import INJECT_FAULT_ENV, StepFaults
from vllm_spec_plugins.tools.runner import run_isolated

SHIPPED_MAMBA = "vllm_spec_plugins:smollm2-135m-instruct-mamba"


def _job(model, prompts, spec=None):
    return {"model": model, "speculative_config": spec, "groups": {"all": prompts}, "max_tokens": 24,
            "temperature": 0.0, "batch_size": 4, "dtype": "float32", "max_model_len": 2048,
            "llm_kwargs": {"enforce_eager": True}, "report_plugin_state": True}


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    return heldout_prompts[:6]


@pytest.fixture(scope="module")
def plain(default_model, prompts):
    return run_isolated(_job(default_model, prompts))["groups"]["all"]["outputs"]


# One run per method family; each place faults once, on a step where drafts are in flight.
FAMILIES = {
    "lookahead_tree": ({"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "tree": True,
                        "goodput": False}, "propose:3,begin:5,attend:100,accept:2"),
    "lookahead_chain": ({"method": "lookahead", "num_speculative_tokens": 4, "goodput": False},
                        "propose:3,begin:6"),
    "mamba": ({"method": "mamba", "num_speculative_tokens": 3, "model": SHIPPED_MAMBA, "goodput": False},
              "propose:2,propose:7"),
    # two tree shapes: whichever the bandit picks (timing decides), a drafting step verifies a
    # tree; without the row gate, whose price of a node is measured time, nodes are never cut to
    # a chain (a chain has no tree attention for `attend` faults to land in)
    "bandit_tree": ({"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0,
                     "shapes": [[2, 1], [2, 1, 1]], "row_gate": False}, "propose:4,attend:100,accept:2"),
    "cascade": ({"method": "cascade", "num_speculative_tokens": 4, "model": SHIPPED_MAMBA, "goodput": False},
                "propose:3"),
}


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.extended if f == "cascade" else []) for f in FAMILIES])
def test_injected_faults_keep_serving_and_lossless(family, default_model, prompts, plain):
    spec, faults = FAMILIES[family]
    res = run_isolated(_job(default_model, prompts, spec), env={INJECT_FAULT_ENV: faults})
    got = res["groups"]["all"]
    assert len(got["outputs"]) == len(prompts)
    for i, (a, b) in enumerate(zip(got["outputs"], plain)):
        assert a == b, f"prompt {i}: {family} output differs from plain vLLM after injected faults"
    counted = res["plugin_state"][0]["faults"]
    want = {}
    for item in faults.split(","):
        place = item.split(":")[0]
        want[place] = want.get(place, 0) + 1
    assert counted == want, counted
    assert got["drafts"] > 0 and got["accepted"] > 0     # it went on speculating after the faults
    assert res["plugin_state"][0]["requests"] <= 1          # state of faulted requests freed too


def test_fault_injection_parses_and_counts():
    f = StepFaults("lookahead", inject="propose:2,attend:1")
    with pytest.raises(RuntimeError, match="attend call 1"):
        f.enter("attend")
    f.enter("propose")
    with pytest.raises(RuntimeError, match="propose call 2"):
        f.enter("propose")
    f.enter("propose")
    f.record("propose", RuntimeError("x"), ["r1"])
    assert f.counts == {"propose": 1}
    assert StepFaults("lookahead", inject="")._inject == {}
