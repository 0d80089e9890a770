"""scripts/bench.py's pure parts."""
import json
import sys

import pytest
from _scripts import load

bench = load("bench")


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
    replay = load("tree_tau_replay")
    # rank of the target's token among the drafter's top tokens at each answer position (0: the
    # chain's token; a leaf of width w holds ranks < w, and the path ends at a leaf)
    ranks = [[0, 0, 1, 5, 0, 2]]
    assert replay.tau((1,), ranks) == pytest.approx(6 / 4)         # 0+ | 1 | 5 | 0+
    assert replay.tau((1, 1, 1), ranks) == pytest.approx(6 / 3)    # 0 0 + | 5 | 0 +
    assert replay.tau((2, 1, 1), ranks) == pytest.approx(6 / 3)    # the 2-wide level is depth 1 only
    assert replay.tau((1, 1, 2), ranks) == pytest.approx(6 / 2)    # 0 0 1(leaf) + | 0 +


def test_goodput_replay_prices_steps_on_its_own_clock():
    """A repetitive answer replayed through `lookahead`: the same tokens as plain (the replay
    asserts it), fewer steps, and a set time below plain's where a draft costs little. Every
    draft it verifies is accepted: as in the plugin, none past max_tokens is verified (a chain
    copied from the repeating text would run past the answer's end)."""
    replay = load("goodput_replay")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2, [20, 21, 22, 23, 24, 25] * 3]
    answers = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 6, [20, 21, 22, 23, 24, 25] * 8]
    params = {"vocab_size": 100}
    cheap = (0.05, 0.001, 0.002, 0)      # step, token, jump seconds; knee tokens
    [plain] = replay.replay("plain", [(prompts, answers)], 2, cheap, params)
    [la] = replay.replay("lookahead", [(prompts, answers)], 2, cheap, params)
    assert plain["tau"] == pytest.approx(1.0) and la["tau"] > 3 and la["seconds"] < plain["seconds"] / 2
    assert la["precision"] == 1.0
    # --proposer-time: the same steps, each also charged the proposal's own (real) seconds
    [timed] = replay.replay("plain", [(prompts, answers)], 2, cheap, params, proposer_time=True)
    assert timed["tau"] == plain["tau"] and timed["seconds"] > plain["seconds"]
    # --noise: the same steps, each one's seconds scaled by seeded noise
    noisy = [replay.replay("plain", [(prompts, answers)], 2, cheap, params, noise=0.2, seed=s)[0] for s in (1, 1, 2)]
    assert noisy[0] == noisy[1] and noisy[0]["tau"] == plain["tau"]
    assert len({plain["seconds"], noisy[0]["seconds"], noisy[2]["seconds"]}) == 3


def test_goodput_replay_sequence_carries_state_across_sets():
    """--sequence: one proposer serves the sets in turn. A second set whose answer repeats the
    first set's answer (not its own prompt) drafts from the shared pool only when it follows the
    first on the same proposer."""
    replay = load("goodput_replay")
    text = [30 + (7 * i) % 50 for i in range(40)]            # 40 distinct tokens: no match in itself
    first = ([[1, 2, 3]], [text])
    second = ([[4, 3, 2, 1]], [text])
    params = {"vocab_size": 100}
    cheap = (0.05, 0.001, 0.002, 0)      # step, token, jump seconds; knee tokens
    [alone] = replay.replay("lookahead", [second], 1, cheap, params)
    after = replay.replay("lookahead", [first, second], 1, cheap, params)
    assert len(after) == 2 and after[1]["tau"] > alone["tau"] + 1


def test_interleave_memory_warning(tmp_path, capsys):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       24000000 kB\nMemAvailable:   23068672 kB\n")     # 22 GiB
    assert not bench.warn_memory(9, str(mi))
    assert bench.warn_memory(11, str(mi)) and "11 engines" in capsys.readouterr().err
    assert not bench.warn_memory(11, str(tmp_path / "missing"))
    bench.check_memory(10, str(mi))
    mi.write_text("MemTotal:       24000000 kB\nMemAvailable:     300000 kB\n")
    with pytest.raises(SystemExit, match="0.29 GiB of memory left with 10 engines up"):
        bench.check_memory(10, str(mi))


def test_prime_memory_writes_what_is_available_less_the_growth(tmp_path):
    """It writes the available memory less what engines grow by, in whole chunks, and nothing
    where the available memory is unknown or under that margin."""
    mi = tmp_path / "meminfo"
    mi.write_text(f"MemAvailable: {int((bench.GROWTH_GIB + 4.5 / 1024) * 2**20)} kB\n")
    assert bench.prime_memory(str(mi), chunk_mib=1) == 4 / 1024
    mi.write_text(f"MemAvailable: {int(bench.GROWTH_GIB * 2**20) // 2} kB\n")
    assert bench.prime_memory(str(mi), chunk_mib=1) == 0.0
    assert bench.prime_memory(str(tmp_path / "missing")) == 0.0


def test_engines_up_stops_when_the_rest_will_not_fit(tmp_path, monkeypatch):
    """The engines up so far measure what one takes: a run that will not fit stops after two,
    every engine started closed; one that fits comes up whole."""
    from vllm_spec_plugins.tools import runner
    mi = tmp_path / "meminfo"
    kib = {"avail": 22 * 2**20}
    mi.write_text(f"MemAvailable: {kib['avail']} kB\n")
    closed = []

    class FakeEngine:                                    # each takes 2.4 GiB
        def __init__(self, job, env=None):
            kib["avail"] -= int(2.4 * 2**20)
            mi.write_text(f"MemAvailable: {kib['avail']} kB\n")

        def close(self):
            closed.append(self)

    monkeypatch.setattr(runner, "EngineProcess", FakeEngine)
    quiet = lambda it, **kw: it                          # noqa: E731 (tqdm's place)
    jobs = {f"m{i}": {} for i in range(10)}
    with pytest.raises(SystemExit, match="2 engines up took ~2.4 GiB each.*run at most 8 engines"):
        with bench.engines_up(jobs, {}, quiet, meminfo=str(mi)):
            pass
    assert len(closed) == 2
    kib["avail"], closed[:] = 22 * 2**20, []
    mi.write_text(f"MemAvailable: {kib['avail']} kB\n")
    with bench.engines_up({f"m{i}": {} for i in range(8)}, {}, quiet, meminfo=str(mi)) as up:
        assert len(up) == 8
    assert len(closed) == 8


# ------------------------------------------------------------------ host record
LSCPU_AMX = """Architecture:            x86_64
Vendor ID:               GenuineIntel
  Model name:            Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
    Thread(s) per core:  2
    Socket(s):           1
    Flags:               fpu sse2 avx avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
NUMA:
  NUMA node(s):          1
"""
LSCPU_AVX2 = """Architecture:            x86_64
Vendor ID:               AuthenticAMD
  Model name:            AMD EPYC 7B13
    CPU family:          25
    Model:               1
    Stepping:            1
    Flags:               fpu sse2 avx fma avx2 sha_ni
"""


@pytest.mark.parametrize("text, isa, model", [(LSCPU_AMX, "amx", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"),
                                              (LSCPU_AVX2, "avx2", "AMD EPYC 7B13")])
def test_cpu_info_from_lscpu(text, isa, model):
    info = bench.cpu_info(lscpu=text)
    assert info["cpu_model"] == model and info["isa"] == isa
    assert info["cpu_flags"].split()[0] == "fpu" and "avx2" in info["isa_flags"]
    assert ("amx_tile" in info["isa_flags"]) == (isa == "amx")
    assert info["cpu_family_model_stepping"] == ("25/1/1" if isa == "avx2" else None)


def test_cpu_info_falls_back_to_proc_cpuinfo():
    cpuinfo = ("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Some CPU\nstepping\t: 1\n"
               "flags\t\t: fpu avx512f avx2\n\nprocessor\t: 1\n")
    info = bench.cpu_info(lscpu="", cpuinfo=cpuinfo)
    assert info["cpu_model"] == "Some CPU" and info["isa"] == "avx512"
    assert info["cpu_family_model_stepping"] == "26/2/1"


@pytest.mark.parametrize("flags, isa", [("avx2 avx512f amx_tile", "amx"), ("avx2 avx512f", "avx512"),
                                        ("sse2 avx2", "avx2"), ("fp asimd", "neon"), ("fp asimd sve", "sve"),
                                        ("sse2", "baseline"), ([], "baseline")])
def test_isa_summary(flags, isa):
    assert bench.isa_summary(flags) == isa


def test_host_record_and_code_version_of_this_checkout(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")       # an ISA cap is part of the result
    host = bench.host_record()
    assert host["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    gen_docs = load("gen_docs")
    assert "kernels capped: ONEDNN_MAX_CPU_ISA=AVX2" in gen_docs.host_of({"machine": host})
    assert "capped" not in gen_docs.host_of({"machine": {**host, "env": {}}})
    for key in ("cpu_model", "cpu_flags", "isa", "cpus", "platform", "python"):
        assert key in host
    assert host["isa"] in ("amx", "avx512", "avx2", "sve", "neon", "baseline")
    assert set(host["versions"]) >= {"torch", "vllm"} and host["versions"]["torch"]
    git = bench.git_state()
    if git is not None:             # a checkout (an sdist has no .git)
        assert len(git["sha"]) == 40 and isinstance(git["dirty"], bool)
    cmd = bench.command_line(["--cold", "--prompts", "fresh"])
    assert cmd[0] == sys.executable and cmd[1].endswith("bench.py") and cmd[2:] == ["--cold", "--prompts", "fresh"]


# ------------------------------------------------------------------ methods, conditions
def test_default_methods_have_suffix_beside_ngram():
    args = bench.parse_args([])
    assert args.methods.split(",")[:3] == ["plain", "ngram", "suffix"]
    assert bench.method_configs(args, "M")["suffix"] == {"method": "suffix"}


def test_fixed_budget_rows_follow_each_goodput_method():
    args = bench.parse_args(["--methods", "plain,ngram,suffix,lookahead,lookahead_tree,bandit_tree", "--fixed-budget",
                             "--method-config", 'cascade={"method": "cascade", "num_speculative_tokens": 8}',
                             "--method-config",
                             'la3={"method": "lookahead", "num_speculative_tokens": 3, "goodput": false}'])
    args.methods += ",cascade,la3"
    got = bench.method_configs(args, "M")
    assert list(got) == ["plain", "ngram", "suffix", "lookahead", "lookahead_fixed", "lookahead_tree", "bandit_tree",
                         "cascade", "cascade_fixed", "la3"]
    assert got["lookahead_fixed"] == {**got["lookahead"], "goodput": False}
    assert got["cascade_fixed"]["num_speculative_tokens"] == 8 and got["cascade_fixed"]["goodput"] is False


def test_conditions_and_side_by_side_rows(capsys):
    assert bench.conditions(bench.parse_args([])) == ["warm"]
    assert bench.conditions(bench.parse_args(["--cold"])) == ["cold"]
    assert bench.conditions(bench.parse_args(["--cold", "--warm", "4"])) == ["cold", "warm"]
    row = lambda x, t: {"chat": {"speedup_vs_plain": x, "tau": t}}
    cold = ({"plain": row(1.0, 1.0), "suffix": row(0.9, 1.5)}, {"plain": {"startup_s": 3.0}, "suffix": {}})
    warm = ({"plain": row(1.0, 1.0), "suffix": row(1.1, 1.7)}, {"plain": {"startup_s": 2.0}, "suffix": {}})
    results, raw = bench.merge_conditions({"cold": cold, "warm": warm})
    assert list(results) == ["plain", "suffix", "plain (warm)", "suffix (warm)"]
    assert raw["plain"]["startup_s"] == 3.0 and raw["plain (warm)"]["startup_s"] == 2.0
    bench.print_conditions(results, ["chat"], ["cold", "warm"])
    out = capsys.readouterr().out
    assert "| suffix | 0.90x, 1.50 | 1.10x, 1.70 |" in out


def test_request_latency_beside_tokens_per_s():
    """Lockstep groups carry each request's latency: summarised as the mean against plain's; a
    method whose last request finishes later (tokens/s below plain) can still finish the others
    sooner, and the two figures say so apart."""
    def group(tps, lat):
        return {"tokens_per_s": tps, "tau": 1.0, "drafts": 1, "draft_tokens": 1, "accepted": 0,
                "generated_tokens": 8, "seconds": max(lat), "accepted_per_pos": [0], "request_seconds": lat}
    plain = {"groups": {"chat": group(10.0, [2.0, 4.0])}}
    method = {"groups": {"chat": group(9.0, [1.0, 4.4])}}
    row = bench.summarize(method, plain, greedy=False)["chat"]
    assert row["speedup_vs_plain"] == pytest.approx(0.9)
    assert row["mean_request_s"] == pytest.approx(2.7) and row["latency_vs_plain"] == pytest.approx(3.0 / 2.7)
    del plain["groups"]["chat"]["request_seconds"]           # not measured (not --lockstep): no figure
    assert "latency_vs_plain" not in bench.summarize(method, plain, greedy=False)["chat"]


def test_paired_tau_gap_over_prompts(capsys):
    """tau against suffix's on the same prompts, with an interval from a paired bootstrap: a gap
    every prompt shares clears 0; one carried by a single prompt does not."""
    def rows(steps, tokens=None):
        return {"request_steps": steps, "request_tokens": tokens or [10] * len(steps)}
    same = rows([5] * 20)
    assert bench.paired_tau_gap(same, rows([5] * 20)) == [0.0, 0.0, 0.0]
    gap, lo, hi = bench.paired_tau_gap(rows([4, 5] * 10), rows([5, 6] * 10))
    assert gap == pytest.approx(20 * 10 / 90 - 20 * 10 / 110) and 0 < lo < gap < hi
    one = rows([5] * 19 + [1], [10] * 19 + [40])             # one prompt made of a long repeat
    gap, lo, hi = bench.paired_tau_gap(one, rows([5] * 19 + [8], [10] * 19 + [40]))
    assert gap > 0 and lo <= 0 < hi
    assert bench.paired_tau_gap(same, {}) is None             # per-request steps not counted
    assert bench.paired_tau_gap(same, rows([5] * 19)) is None  # not the same prompts
    results = {"plain": {"chat": rows([10] * 20)}, "suffix": {"chat": rows([5] * 20)},
               "lookahead": {"chat": rows([4] * 20) | {"tokens_per_s": 1.0, "speedup_vs_plain": 1.0, "tau": 2.5,
                                                         "acceptance_rate": 0.5, "acceptance_per_position": []}}}
    bench.tau_gaps(results)
    assert "tau_vs_suffix" not in results["plain"]["chat"] and "tau_vs_suffix" not in results["suffix"]["chat"]
    assert results["lookahead"]["chat"]["tau_vs_suffix"] == [pytest.approx(0.5)] * 3
    bench.print_table({"lookahead": results["lookahead"]}, ["chat"])
    assert "lookahead chat: +0.50 (+0.50 to +0.50)" in capsys.readouterr().out
    gen_docs = load("gen_docs")
    text = "\n".join(gen_docs._tau_gap_table(results, ["chat"]))
    assert "| `lookahead` | +0.50 (+0.50 to +0.50) |" in text and "`suffix`" in text
    assert gen_docs._tau_gap_table({"plain": results["plain"]}, ["chat"]) == []


def test_merged_turns_keep_per_request_steps_where_both_counted():
    from vllm_spec_plugins.tools.runner import merge_groups
    def turn(steps):
        return {"outputs": [[[1] * 4]] * len(steps), "seconds": 1.0, "generated_tokens": 4 * len(steps),
                "drafts": 1, "draft_tokens": 2, "accepted": 1, "preemptions": 0, "accepted_per_pos": [1],
                "target_steps": sum(steps), "request_steps": steps}
    got = merge_groups(turn([2, 3]), turn([4]))
    assert got["request_steps"] == [2, 3, 4] and got["target_steps"] == 9
    uncounted = {k: v for k, v in turn([4]).items() if k not in ("target_steps", "request_steps")}
    got = merge_groups(turn([2, 3]), uncounted)
    assert "request_steps" not in got and "target_steps" not in got


# ------------------------------------------------------------------ prompts
def _args(*argv):
    return bench.parse_args(list(argv))


def test_fresh_prompt_file_loads_as_categories():
    from vllm_spec_plugins.tools import data
    rows = data.fresh_prompts()
    counts = {c: sum(r["category"] == c for r in rows) for c in data.FRESH_CATEGORIES}
    assert counts == {"chat": 48, "code": 40, "repetitive": 32}
    assert len({r["id"] for r in rows}) == len(rows) and all(r["id"].startswith("fresh:") for r in rows)
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "user" and set(roles) <= {"system", "user", "assistant"}
        assert all(m["content"].strip() for m in r["messages"])
    multi = [r for r in rows if r["category"] == "repetitive" and "assistant" in [m["role"] for m in r["messages"]]]
    assert multi, "a multi-turn edit of the same code"
    assert data.dedupe_rows(rows)[1] == []          # no two fresh prompts alike
    got = bench.load_rows(_args("--prompts", "fresh", "--categories", "code,repetitive", "--n-per-category", "2"))
    assert [r["category"] for r in got] == ["code", "code", "repetitive", "repetitive"]
    assert len(bench.load_rows(_args("--prompts", "fresh", "--n-per-category", "0"))) == 120
    with pytest.raises(ValueError, match="summarize"):
        data.fresh_prompts(["summarize"])


def test_fresh_prompts_are_not_in_the_datasets():
    from vllm_spec_plugins.tools import data
    seen = data.train_text_keys()
    seen |= {data._key(m["content"]) for c in data.sharegpt_conversations("heldout") for m in c["messages"]}
    seen |= {data._key(p["prompt"]) for p in data.humaneval_problems(None)}
    for r in data.fresh_prompts():
        assert data._key(data.row_text(r)) not in seen
        assert not any(data._key(m["content"]) in seen for m in r["messages"]), r["id"]


def test_dedupe_by_normalised_text_and_against_warm_up():
    from vllm_spec_plugins.tools import data
    assert data.normalize_text("  Hello\n\tWORLD  ") == "hello world"
    rows = [{"category": "chat", "id": "a", "messages": [{"role": "user", "content": "Tell me a joke."}]},
            {"category": "chat", "id": "b", "messages": [{"role": "user", "content": "tell  me a\nJOKE."}]},
            {"category": "chat", "id": "c", "messages": [{"role": "user", "content": "Write a haiku."}]},
            {"category": "code", "id": "d", "prompt": "def f():"}]
    warm = [{"category": "chat", "id": "w", "messages": [{"role": "user", "content": "WRITE A HAIKU."}]}]
    kept, dropped = data.dedupe_rows(rows, warm)
    assert [r["id"] for r in kept] == ["a", "d"] and [r["id"] for r in dropped] == ["b", "c"]
    groups, gone = bench.group_rows(rows, warm)
    assert {c: [r["id"] for r in g] for c, g in groups.items()} == {"chat": ["a"], "code": ["d"]}
    assert gone == {"chat": ["b", "c"]}


def _ids_in(split, n, prefix):
    from vllm_spec_plugins.tools import data
    out, i = [], 0
    while len(out) < n:
        if data.split_of(f"{prefix}{i}") == split:
            out.append(f"{prefix}{i}")
        i += 1
    return out


def test_heldout_drops_texts_that_training_has(tmp_path, monkeypatch):
    """ShareGPT repeats a text under several ids: a held-out prompt whose normalised text is a
    message of a training conversation (or a warm-up prompt) is not measured."""
    from vllm_spec_plugins.tools import data
    held, train = _ids_in("heldout", 3, "h"), _ids_in("train", 2, "t")
    long = "This is a long enough answer about the history of the bicycle and why it matters. " * 12
    convs = [
        {"id": f"{held[0]}_0", "conversations": [{"from": "human", "value": "What is the capital of France, please?"}]},
        {"id": f"{held[1]}_0", "conversations": [{"from": "human", "value": "How do I bake bread at home with you?"},
                                                 {"from": "gpt", "value": long}]},
        {"id": f"{held[2]}_0",
         "conversations": [{"from": "human", "value": "what is the CAPITAL of   france, please?"}]},
        {"id": f"{train[0]}_0",
         "conversations": [{"from": "human", "value": "How do I  bake bread at home with YOU?"}]},
        {"id": f"{train[1]}_0", "conversations": [{"from": "human", "value": "Summarize this for me"},
                                                  {"from": "gpt", "value": long.upper()}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    monkeypatch.setenv(data.SHAREGPT_ENV, str(path))
    rows = data.make_prompts(categories=("chat", "summarize"), n_per_category=None, split="heldout")
    chat = [data.normalize_text(r["messages"][0]["content"]) for r in rows if r["category"] == "chat"]
    assert chat == ["what is the capital of france, please?"]       # bread: in train; capital: once
    assert not [r for r in rows if r["category"] == "summarize"]    # its answer is a training message
    assert data.make_prompts(categories=("chat",), n_per_category=None, split="train")  # train keeps its own


def test_results_written_by_an_earlier_run_are_not_code_changes():
    changed = ["docs/results/b1.json", "docs/results/b1.png", "docs/benchmarks.md", "proposers/goodput.py"]
    assert bench.code_changes(changed) == ["proposers/goodput.py"]
    assert bench.code_changes(changed[:3]) == []


def test_an_engine_interrupted_while_starting_is_stopped(monkeypatch):
    """`kill` of bench.py (SIGTERM -> SystemExit) while an engine process starts: that process is
    stopped, not left to finish a start-up nobody will read."""
    import signal
    import subprocess

    from vllm_spec_plugins.tools import runner
    procs = []

    class Popen(subprocess.Popen):           # an engine whose start-up never ends
        def __init__(self, cmd, **kw):
            super().__init__([sys.executable, "-c", "import time; time.sleep(120)"], **kw)
            procs.append(self)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(runner.subprocess, "Popen", Popen)
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.alarm(1)
        with pytest.raises(SystemExit):
            runner.EngineProcess({"model": "unused"})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert len(procs) == 1 and procs[0].poll() is not None


def test_engine_args_go_to_the_engine_not_to_speculative_config():
    args = bench.parse_args(["--methods", "plain,plain_sync,la", "--method-config",
                             'la={"method": "lookahead", "engine_args": {"enforce_eager": true}}'])
    got = bench.method_configs(args, "M")
    base = {"model": "M", "llm_kwargs": {"enforce_eager": False}}
    plain_sync = bench.engine_job(base, got["plain_sync"])
    assert plain_sync["speculative_config"] is None and not plain_sync["report_plugin_state"]
    assert plain_sync["llm_kwargs"] == {"enforce_eager": False, "async_scheduling": False}
    la = bench.engine_job(base, got["la"])
    assert la["speculative_config"] == {"method": "lookahead"} and la["report_plugin_state"]
    assert la["llm_kwargs"] == {"enforce_eager": True}
    assert bench.engine_job(base, None)["llm_kwargs"] == base["llm_kwargs"]
    assert bench.engine_split({"method": "suffix"}) == ({"method": "suffix"}, {})
