"""scripts/bench.py's pure parts."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench", Path(__file__).parent.parent / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _classify(margin, dtype, reference=(7, 8, 9)):
    """A method's output first differs from plain's (7, 8, 9) at token 2; the logprobs run
    (`reference` its output) has the target's top-2 `margin` apart there."""
    plain = {"groups": {"chat": {"outputs": [[[7, 8, 9]]]}}}
    lps = [{1: -0.1, 2: -0.5}] * 2 + [{1: -0.1, 2: -0.1 - margin}]
    plain_lp = {"groups": {"chat": {"logprobs": [[lps]], "outputs": [[list(reference)]]}}}
    results = {"m": {"chat": {"identical_to_plain": False, "_first_diff": [2]}}}
    bench.classify_mismatches(results, plain_lp, dtype, plain)
    return results["m"]["chat"]["mismatch_analysis"][0]


@pytest.mark.parametrize("margin, kind", [(0.0, "near-tie"), (0.5000000596046448, "near-tie"),
                                          (0.625, "BUG"), (2.0, "BUG")])
def test_bf16_mismatch_is_a_near_tie_up_to_four_bf16_steps(margin, kind):
    # 0.50000006 is what a float32 logprob difference of exactly 4 bf16 steps (0.125) came back as
    assert _classify(margin, "bfloat16")["kind"] == kind


def test_float32_mismatch_is_always_a_bug():
    assert _classify(0.0, "float32")["kind"] == "BUG"


def test_margin_from_a_reference_run_that_left_plains_text_is_not_used():
    # batch 8, bf16: the logprobs run took another branch at token 1, so its margin at token 2
    # is for another text
    got = _classify(2.0, "bfloat16", reference=(7, 5, 9))
    assert got["kind"] == "unknown" and got["top2_margin"] is None and got["reference_diverged_at"] == 1
