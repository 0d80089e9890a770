"""`vllm-spec serve --config configs/<method>.yaml`: the real OpenAI server on 127.0.0.1, with the
plugin loaded in the API server and the engine-core process; greedy output equals plain vLLM."""
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_spec_plugins.tools.load import free_port as _free_port
from vllm_spec_plugins.tools.load import stop_group
from vllm_spec_plugins.tools.runner import run_isolated

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("ray"))


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# Default suite: the lookahead and mamba drop-ins; slow (CI): bandit_tree and cascade, the other two
# methods; extended: the rest (the same paths through the server, other keys).
def _marks(config: str) -> list:
    if config in ("lookahead.yaml", "mamba_smollm2.yaml"):
        return []
    if config in ("bandit_tree.yaml", "cascade_smollm2.yaml"):
        return [pytest.mark.slow]
    return [pytest.mark.extended]


@pytest.mark.parametrize("config", [pytest.param(c, marks=_marks(c)) for c in CONFIGS])
def test_serve_yaml_dropin(config, default_model, heldout_prompts, tmp_path):
    prompts = heldout_prompts[:3]
    plain = run_isolated({"model": default_model, "groups": {"p": prompts}, "max_tokens": 24,
                          "dtype": "float32", "batch_size": 4,
                          "llm_kwargs": {"enforce_eager": True}})["groups"]["p"]
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_spec_plugins", "serve", default_model,
         "--config", str(ROOT / "configs" / config), "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                _get(base + "/health")
                break
            except Exception:
                assert time.time() < deadline, "server did not come up"
                time.sleep(1)
        for ids, want in zip(plain["prompt_token_ids"], plain["texts"]):
            r = _post(base + "/v1/completions", {"model": default_model, "prompt": ids,
                                                  "max_tokens": 24, "temperature": 0.0})
            assert r["choices"][0]["text"] == want[0]
        metrics = _get(base + "/metrics")
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
        assert drafts and sum(drafts) > 0, "no drafts counted in vllm:spec_decode_* metrics"
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server + engine core), SIGKILL if it hangs."""
    stop_group(proc, 60)
