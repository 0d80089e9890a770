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


def _sweep_results():
    """bandit `bt` beside its fixed shapes (chain 1-1-1, trees 3-1 and 4-2-1): chat and code."""
    rows = {"bt": (80.0, 1.70, 70.0, 1.90), "bt@1-1-1": (76.0, 1.60, 72.0, 1.94),
            "bt@3-1": (81.0, 1.70, 66.0, 1.80), "bt@4-2-1": (77.0, 1.85, 60.0, 2.10)}
    return {n: {"chat": {"tokens_per_s": a, "tau": b}, "code": {"tokens_per_s": c, "tau": d}}
            for n, (a, b, c, d) in rows.items()}


def test_bandit_report_against_its_sweep_and_the_plots(tmp_path):
    results = _sweep_results()
    state = {"shapes": [[1, 1, 1], [3, 1], [4, 2, 1]],
             "tables": {"chat|1": {"pulls": [5, 90, 5], "mean_reward": [70.0, 80.0, None]},
                        "code|1": {"pulls": [90, 5, 5], "mean_reward": [75.0, 60.0, 55.0]}},
             "history": [[i, "chat" if i < 50 else "code", 1, i % 3, 70.0] for i in range(100)]}
    raw = {n: {} for n in results}
    raw["bt"] = {"plugin_state": [{"bandit": state}], "group_start_step": {"chat": 0, "code": 50}}
    configs = {"bt": {"method": "bandit_tree", "drafter": "mamba"}} | {n: None for n in results if "@" in n}
    bench.bandit_report(results, raw, configs, None)
    chat, code = results["bt"]["chat"], results["bt"]["code"]
    assert chat["best_fixed_shape"] == "3-1" and chat["vs_best_fixed_shape"] == pytest.approx(80 / 81)
    assert code["best_fixed_shape"] == "1-1-1" and code["vs_best_fixed_shape"] == pytest.approx(70 / 72)
    assert chat["best_static_chain"] == "bt@1-1-1" and chat["tau_vs_best_static_chain"] == pytest.approx(1.70 / 1.60)
    assert chat["bandit_tables"]["chat|1"]["3-1"] == {"pulls": 90, "mean_reward": 80.0}
    bench.plot_bandit(raw["bt"], tmp_path / "shapes.png", "bt")
    bench.plot_sweep(results, "bt", ["chat", "code"], tmp_path / "sweep.png", "bt")
    assert (tmp_path / "shapes.png").stat().st_size > 10_000 and (tmp_path / "sweep.png").stat().st_size > 10_000


def test_tree_tau_replay_walks_spine_and_leaves():
    spec = importlib.util.spec_from_file_location("replay", Path(__file__).parent.parent / "scripts" / "tree_tau_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    # rank of the target's token among the drafter's top tokens at each answer position (0: the
    # chain's token; a leaf of width w holds ranks < w, and the path ends at a leaf)
    ranks = [[0, 0, 1, 5, 0, 2]]
    assert replay.tau((1,), ranks) == pytest.approx(6 / 4)         # 0+ | 1 | 5 | 0+
    assert replay.tau((1, 1, 1), ranks) == pytest.approx(6 / 3)    # 0 0 + | 5 | 0 +
    assert replay.tau((2, 1, 1), ranks) == pytest.approx(6 / 3)    # the 2-wide level is depth 1 only
    assert replay.tau((1, 1, 2), ranks) == pytest.approx(6 / 2)    # 0 0 1(leaf) + | 0 +


def test_interleave_memory_warning(tmp_path, capsys):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       24000000 kB\nMemAvailable:   23068672 kB\n")     # 22 GiB
    assert not bench.warn_memory(9, str(mi))
    assert bench.warn_memory(11, str(mi)) and "11 engines" in capsys.readouterr().err
    assert not bench.warn_memory(11, str(tmp_path / "missing"))
