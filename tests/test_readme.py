"""The README's first command, as written, on this machine: set-up, then `vllm-spec serve` with no
VLLM_* variable set (so the plugin must size vLLM's CPU KV cache itself), then the README's curl
request, whose answer and vLLM's /metrics are checked. Also the KV-cache sizing alone, against the
memory a small fresh node reports."""
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from test_serve import _get, stop

from vllm_spec_plugins import memory

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _bash_blocks() -> list[list[str]]:
    """Commands of the README's ```bash blocks (comments and blank lines dropped)."""
    text = (ROOT / "README.md").read_text()
    return [[ln for ln in b.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_first_command_serves_as_written(tmp_path):
    blocks = _bash_blocks()
    serve = blocks[0][0]
    assert "vllm-spec serve" in serve, serve
    curl = next(ln for b in blocks for ln in b if ln.startswith("curl "))
    port = int(re.search(r"127\.0\.0\.1:(\d+)", curl).group(1))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} (the README's) is taken"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):      # this suite's settings, not a user's
        env.pop(k, None)
    log_path = tmp_path / "readme_serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(["bash", "-c", serve], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except Exception:
                assert time.time() < deadline, "server did not come up: " + log_path.read_text()[-2000:]
                time.sleep(2)
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, env=env, timeout=300)
        assert answer.returncode == 0, answer.stderr
        import json
        body = json.loads(answer.stdout)
        assert body["choices"][0]["text"].strip(), body
        assert body["usage"]["completion_tokens"] > 0
        metrics = _get(f"http://127.0.0.1:{port}/metrics")
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and sum(drafts) > 0, "no drafts in vllm:spec_decode_* metrics"
        assert "the KV cache gets" in log_path.read_text()   # it said what it chose
    finally:
        stop(proc)
        log.close()


def test_kv_cache_fits_a_small_fresh_node(monkeypatch):
    """The node a fresh machine shows (7.46 GiB, 6.0 available once the API server and engine
    core are up): vLLM's default wants 0.92 x 7.46 = 6.87 GiB and refuses; the chosen size fits."""
    total, available = int(7.46 * GiB), int(6.0 * GiB)
    assert 0.92 * total > available                         # vLLM's own start-up check fails
    gib = memory.fit_kv_cache_gib(available, weights=269 * 2**20)
    assert 1 <= gib and gib * GiB + memory.PROCESS_OVERHEAD < available
    assert memory.fit_kv_cache_gib(int(0.5 * GiB)) == 1      # never 0: vLLM would refuse
    assert memory.fit_kv_cache_gib(200 * GiB) > 50           # a large node gets a large cache

    monkeypatch.setattr(memory, "node_memory", lambda node=0: (total, available))
    env = {}
    assert memory.choose_for_serve(["vllm", "serve", "m"], None, env) == memory.fit_kv_cache_gib(available)
    assert env[memory.ENV] == str(memory.fit_kv_cache_gib(available))
    # the user's choice wins
    for argv, env in ((["vllm", "serve", "m", "--kv-cache-memory-bytes", "1G"], {}),
                      (["vllm", "serve", "m", "--gpu-memory-utilization=0.5"], {}),
                      (["vllm", "serve", "m"], {memory.ENV: "3"})):
        assert memory.choose_for_serve(argv, None, env) is None
        assert env.get(memory.ENV) in (None, "3")
