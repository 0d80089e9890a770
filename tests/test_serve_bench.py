"""scripts/serve_bench.py's pure parts (no server): the prompt files `vllm bench serve` reads, the
summary of its result, and the docs/benchmarks.md section scripts/gen_docs.py renders from it."""
import json
from pathlib import Path

import pytest
from _scripts import load

sb = load("serve_bench")
gen_docs = load("gen_docs")

TEXTS = ["<|im_start|>user\nSay \"hi\" — twice.<|im_end|>\n<|im_start|>assistant\n", "second\n\n{json: 1}"]


# ---------------------------------------------------------------- prompt files
def test_custom_dataset_is_one_prompt_per_line_in_order(tmp_path):
    path = sb.write_dataset(str(tmp_path / "chat.jsonl"), TEXTS, "custom")
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    assert [json.loads(ln) for ln in lines] == [{"prompt": t} for t in TEXTS]


def test_sharegpt_dataset_is_read_back_by_vllm_unchanged_and_in_order(tmp_path, default_model):
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import ShareGPTDataset
    path = sb.write_dataset(str(tmp_path / "chat.json"), TEXTS, "sharegpt")
    ds = ShareGPTDataset(random_seed=0, dataset_path=path, disable_shuffle=True)
    got = ds.sample(tokenizer=AutoTokenizer.from_pretrained(default_model), num_requests=len(TEXTS),
                    output_len=128, no_oversample=True)
    assert [r.prompt for r in got] == TEXTS
    assert [r.expected_output_len for r in got] == [128, 128]


def test_prompt_text_gives_the_tokens_bench_py_engines_serve(default_model):
    """The text written for bench serve, tokenized as the server is asked to (no special tokens),
    is token for token what scripts/bench.py's engines get for the same fresh rows."""
    from transformers import AutoTokenizer

    from vllm_spec_plugins.tools.runner import to_token_prompts
    tok = AutoTokenizer.from_pretrained(default_model)
    args = sb.parse_args(["--n-per-category", "2"])
    groups = sb.category_rows(args)
    assert list(groups) == ["chat", "code", "repetitive"] and all(len(g) == 2 for g in groups.values())
    rows = [r for g in groups.values() for r in g]
    assert any("messages" in r for r in rows)
    ours = [tok.encode(sb.prompt_text(tok, r), add_special_tokens=False) for r in rows]
    assert ours == to_token_prompts(tok, rows)


def test_sharegpt_refuses_prompts_vllm_would_skip():
    sb.check_sharegpt_lengths([4, 1024], 128)
    for lens in ([3], [1025], [1000 + 1]):
        with pytest.raises(SystemExit):
            sb.check_sharegpt_lengths(lens, 1048)


def test_bench_command_is_cold_ordered_and_sends_no_special_tokens():
    args = sb.parse_args(["--max-tokens", "128"])
    for name in ("custom", "sharegpt"):
        argv = sb.bench_argv("http://127.0.0.1:1", "M", "f", 6, "d", "r.json", args, name)
        assert argv[:2] == ["bench", "serve"]
        for flag in ("--disable-shuffle", "--no-oversample", "--save-result"):
            assert flag in argv
        assert "--num-warmups" not in argv and "--ready-check-timeout-sec" not in argv     # cold
        assert json.loads(argv[argv.index("--extra-body") + 1]) == {"add_special_tokens": False}
        assert argv[argv.index("--max-concurrency") + 1] == "1"
        assert argv[argv.index("--dataset-name") + 1] == name
    custom = sb.bench_argv("u", "M", "f", 6, "d", "r.json", args, "custom")
    assert "--skip-chat-template" in custom and custom[custom.index("--custom-output-len") + 1] == "128"
    serve = sb.serve_argv("M", {"method": "lookahead"}, 9, sb.parse_args([]))
    assert json.loads(serve[serve.index("--speculative-config") + 1]) == {"method": "lookahead"}
    assert "--speculative-config" not in sb.serve_argv("M", None, 9, sb.parse_args([]))
    # a config's engine arguments become vLLM's own flags
    sync = sb.serve_argv("M", sb.bench.DEFAULT_CONFIGS["plain_sync"], 9, sb.parse_args([]))
    assert "--no-async-scheduling" in sync and "--speculative-config" not in sync
    both = sb.serve_argv("M", {"method": "lookahead", "engine_args": {"enforce_eager": True,
                                                                      "max_num_batched_tokens": 512}},
                         9, sb.parse_args([]))
    assert "--enforce-eager" in both and both[both.index("--max-num-batched-tokens") + 1] == "512"
    assert json.loads(both[both.index("--speculative-config") + 1]) == {"method": "lookahead"}


def test_method_configs_come_from_bench_py():
    assert sb.bench.DEFAULT_CONFIGS["lookahead"] is not None
    assert set(sb.DEFAULT_METHODS.split(",")) <= set(sb.bench.DEFAULT_CONFIGS)


# ---------------------------------------------------------------- results
def _bench_serve_result(tok_s, texts, spec=True):
    """What `vllm bench serve --save-result --save-detailed` writes (the keys used, and arrays)."""
    res = {"duration": 10.0, "completed": len(texts), "failed": 0, "total_input_tokens": 300,
           "total_output_tokens": 768, "output_throughput": tok_s, "mean_ttft_ms": 120.5,
           "median_ttft_ms": 118.0, "mean_tpot_ms": 19.25, "median_tpot_ms": 19.0, "mean_itl_ms": 30.0,
           "ttfts": [0.1] * len(texts), "itls": [[0.02] * 5] * len(texts), "input_lens": [50] * len(texts),
           "output_lens": [128] * len(texts), "generated_texts": list(texts), "errors": [""] * len(texts)}
    if spec:
        res |= {"spec_decode_acceptance_rate": 41.5, "spec_decode_acceptance_length": 2.49,
                "spec_decode_num_drafts": 300, "spec_decode_draft_tokens": 1800,
                "spec_decode_accepted_tokens": 447, "spec_decode_per_position_acceptance_rates": [0.6, 0.4, 0.2]}
    return res


def test_summary_keeps_no_per_request_arrays():
    row = sb.summarize_run(_bench_serve_result(60.0, ["a", "b"]))
    assert row["output_tokens_per_s"] == 60.0 and row["mean_tpot_ms"] == 19.25 and row["mean_ttft_ms"] == 120.5
    assert row["acceptance_length"] == 2.49 and row["acceptance_rate_pct"] == 41.5
    assert row["acceptance_per_position"] == [0.6, 0.4, 0.2] and row["drafts"] == 300
    assert not {"ttfts", "itls", "input_lens", "output_lens", "errors", "generated_texts"} & set(row)
    plain = sb.summarize_run(_bench_serve_result(40.0, ["a", "b"], spec=False))
    assert "acceptance_length" not in plain


def test_speedup_and_same_text_vs_plain():
    results = {"plain": {"chat": sb.summarize_run(_bench_serve_result(40.0, ["a", "b"], spec=False))},
               "lookahead": {"chat": sb.summarize_run(_bench_serve_result(60.0, ["a", "x"]))}}
    again = {"chat": sb.summarize_run(_bench_serve_result(44.0, ["a", "b"], spec=False))}
    sb.merge_plain_rerun(results["plain"], again)
    sb.add_vs_plain(results, greedy=True)
    assert results["plain"]["chat"]["output_tokens_per_s_first_last"] == [40.0, 44.0]
    assert results["plain"]["chat"]["output_tokens_per_s"] == 42.0
    assert results["lookahead"]["chat"]["speedup_vs_plain"] == pytest.approx(60 / 42, abs=1e-4)
    assert results["lookahead"]["chat"]["same_text_as_plain"] == 1
    assert "_texts" not in json.dumps(results)


def test_request_count_from_prometheus_text():
    text = ("# HELP vllm:request_success_total x\n"
            'vllm:request_success_total{engine="0",finished_reason="stop"} 2.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length"} 3.0\n'
            "vllm:request_success_total_created 1.7e9\n")
    assert sb.prom_sum(text, "vllm:request_success_total") == 5.0
    assert sb.prom_sum(text, "vllm:num_requests_running") is None


# ---------------------------------------------------------------- docs/benchmarks.md
def _serve_json(before=0):
    cats = ("chat", "code")
    plain = {c: {"output_tokens_per_s": 50.0, "output_tokens_per_s_first_last": [49.0, 51.0],
                 "mean_ttft_ms": 120.4, "mean_tpot_ms": 19.06, "completed": 6, "speedup_vs_plain": 1.0}
             for c in cats}
    la = {c: {"output_tokens_per_s": 70.0, "mean_ttft_ms": 130.0, "mean_tpot_ms": 12.5, "completed": 6,
              "acceptance_length": 2.345, "speedup_vs_plain": 1.4, "same_text_as_plain": 5} for c in cats}
    return {"kind": sb.KIND, "results": {"plain": plain, "lookahead": la},
            "command": "python scripts/serve_bench.py --json x.json", "git": {"sha": "abc123", "dirty": False},
            "config": {"prompts": "fresh", "n_prompts": {"chat": 6, "code": 6}, "batch_size": 1, "max_tokens": 128,
                       "dtype": "bfloat16", "temperature": 0.0, "threads": 2, "warmup_requests": 0,
                       "ready_check": False, "plain_runs": 2,
                       "method_configs": {"plain": None, "lookahead": {"method": "lookahead"}},
                       "server_commands": {"plain": "vllm-spec serve M --max-num-seqs 1"},
                       "bench_command": "vllm-spec bench serve --dataset-name custom"},
            "machine": {"cpu_model": "AMD EPYC", "cpu_flags": "avx512f", "cpus": 2},
            "requests_before_measuring": {"plain": 0, "lookahead": before}}


def test_benchmarks_page_renders_a_serve_result_after_bench_results(tmp_path):
    (tmp_path / "a_serve.json").write_text(json.dumps(_serve_json()))
    (tmp_path / "z_other.json").write_text(json.dumps({"kind": "something else"}))
    text = gen_docs.render_results(str(tmp_path))
    assert text.index("## `z_other`") < text.index("## `a_serve`")        # after bench.py sections
    sec = text.split("## `a_serve`", 1)[1]
    assert "python scripts/serve_bench.py --json x.json\n```" in sec
    assert "code version: `abc123`" in sec and "CPU AMD EPYC" in sec
    assert "prompts: `fresh`: chat 6, code 6" in sec
    assert "answer length: 128 tokens; dtype bfloat16; temperature 0.0" in sec
    assert "cold/warm: **cold**" in sec and "no warm-up or test request" in sec
    assert "client, per category: `vllm-spec bench serve --dataset-name custom`" in sec
    assert ("| `plain` | 50.0 (1.00x; first / last server 49.0 / 51.0) | - | "
            "50.0 (1.00x; first / last server 49.0 / 51.0) | - | - |") in sec
    assert "| `lookahead` | 70.0 (1.40x) | 2.35 | 70.0 (1.40x) | 2.35 | 10 of 12 |" in sec
    assert "| `plain` | 120 / 19.1 | 120 / 19.1 |" in sec
    assert '- `lookahead`: `{"method": "lookahead"}`' in sec


def test_benchmarks_page_says_when_a_server_was_not_cold(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(_serve_json(before=3)))
    text = gen_docs.render_results(str(tmp_path))
    assert "**not cold**" in text and "`lookahead` 3" in text
