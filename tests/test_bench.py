"""scripts/bench.py's pure parts."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench", Path(__file__).parent.parent / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _classify(margin, dtype):
    # plain's logprobs at token 0 of one prompt: the top-2 of the target
    plain_lp = {"groups": {"chat": {"logprobs": [[[{1: -0.1, 2: -0.1 - margin}]]]}}}
    results = {"m": {"chat": {"identical_to_plain": False, "_first_diff": [0]}}}
    bench.classify_mismatches(results, plain_lp, dtype)
    return results["m"]["chat"]["mismatch_analysis"][0]["kind"]


@pytest.mark.parametrize("margin, kind", [(0.0, "near-tie"), (0.5000000596046448, "near-tie"),
                                          (0.625, "BUG"), (2.0, "BUG")])
def test_bf16_mismatch_is_a_near_tie_up_to_four_bf16_steps(margin, kind):
    # 0.50000006 is what a float32 logprob difference of exactly 4 bf16 steps (0.125) came back as
    assert _classify(margin, "bfloat16") == kind


def test_float32_mismatch_is_always_a_bug():
    assert _classify(0.0, "float32") == "BUG"
