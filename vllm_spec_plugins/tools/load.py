"""Load and faults through the real OpenAI server (``python scripts/load.py``; loopback only, bounded).

For plain vLLM and each method: start ``vllm-spec serve`` on 127.0.0.1, send N requests at a fixed
concurrency with mixed prompt lengths (up to the context) and mixed sampling parameters in one
batch (greedy, T=0.7 seeded, top-p, stop strings, logprobs, n=2, JSON-schema output, streams the
client drops mid-way), prefix caching on. Then: the seeded sampled requests again (must repeat),
the server's ``vllm:spec_decode_*`` counters (tau, per-position acceptance) and the plugin's
per-request state in every worker (``collective_rpc`` through ``VLLM_SERVER_DEV_MODE``; must be back
to its baseline). Greedy responses are compared with plain vLLM's (float32: must be equal).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from vllm_spec_plugins.tools.runner import tau_of

METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # as the serving drop-ins in configs/ (goodput on: the default)
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 16},
    "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 16},
    "mamba": {"method": "mamba", "num_speculative_tokens": 4,
              "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
    "cascade": {"method": "cascade", "num_speculative_tokens": 8,
                "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
}
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
               "required": ["answer", "confidence"]}
# request kind by index % 20: 40% greedy, 10% greedy+stop, 10% greedy+logprobs, 15% T=0.7 seeded,
# 10% top-p seeded, 5% n=2 seeded, 5% JSON schema (greedy), 5% stream dropped by the client
KINDS = ["greedy"] * 8 + ["stop"] * 2 + ["logprobs"] * 2 + ["temp"] * 3 + ["top_p"] * 2 + ["n2", "json", "drop"]
SEEDED = ("temp", "top_p", "n2")
GREEDY = ("greedy", "stop", "logprobs", "json")
# every 25th request is malformed (cycling through these): the server must answer 4xx with a
# message and keep serving everything else
BAD = [("temperature", -1.0), ("max_tokens", "context"), ("prompt", "out_of_vocab"), ("logprobs", 1000),
       ("top_p", 1.5), ("n", 0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, term_wait: float) -> None:
    """End `proc`'s process group (a server started with start_new_session: API server, engine
    core, workers): SIGTERM, and SIGKILL if it has not exited within `term_wait` seconds."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# The server's reaper: a small process that SIGKILLs the server's whole process group (API server,
# engine core, workers) when this process dies, however it dies (SIGKILL included, which no `with`
# or signal handler sees). Measured: with only the API server killed, vLLM's engine core and worker
# outlive it. Linux (PR_SET_PDEATHSIG); elsewhere the reaper exits at once and only `stop` applies.
REAPER = """
import ctypes, os, signal, sys
group, parent = int(sys.argv[1]), int(sys.argv[2])
def reap(*_):
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    os._exit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
if sys.platform != "linux":
    sys.exit(0)
signal.signal(signal.SIGTERM, reap)
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
if os.getppid() != parent:
    reap()
while True:
    signal.pause()
"""


class Server:
    """`vllm-spec serve` on 127.0.0.1 in its own process group; stopped (SIGTERM, then SIGKILL),
    and killed by its reaper if this process dies first."""

    def __init__(self, model: str, spec: dict | None, log: Path, args: list[str], env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm_spec_plugins", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-extension-cls", "vllm_spec_plugins.proposer.StateReport",
               *args]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log = open(log, "w")
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(self.proc.pid), str(os.getpid())])
        self.log_path = log

    def wait_ready(self, timeout: float = 600) -> None:
        import urllib.request
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n" + self.log_path.read_text()[-3000:])
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5).read()
                return
            except Exception:
                if time.time() > deadline:
                    raise TimeoutError("server did not come up; log: " + str(self.log_path))
                time.sleep(1)

    def stop(self) -> None:
        # A second SIGTERM / Ctrl-C while we wait must not cut the SIGKILL short: a server that
        # ignores SIGTERM (measured: vLLM's API server hangs on it during engine start-up) would
        # outlive us.
        main = threading.current_thread() is threading.main_thread()
        held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            stop_group(self.proc, 30)
        finally:
            self.reaper.kill()          # the server is gone: the reaper has nothing left to do
            self.reaper.wait()
            for s, h in held.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            self.log.close()

    def __enter__(self):
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()


def workload(model: str, n: int, max_tokens: int, max_model_len: int, seed: int = 0) -> list[dict]:
    """n request bodies for /v1/completions (token-id prompts), deterministic given seed."""
    import random

    from transformers import AutoTokenizer

    from vllm_spec_plugins.tools.data import make_prompts
    from vllm_spec_plugins.tools.runner import to_token_prompts
    tok = AutoTokenizer.from_pretrained(model)
    rows = make_prompts(categories=("chat", "code", "summarize"), n_per_category=max(4, n // 6 + 1), split="heldout")
    prompts = to_token_prompts(tok, rows)
    rng = random.Random(seed)
    budget = max_model_len - max_tokens - 8
    bodies = []
    for i in range(n):
        p = list(prompts[i % len(prompts)])
        if i % 10 == 9:                       # long: several prompts back to back, up to the context
            while len(p) < budget:
                p += prompts[rng.randrange(len(prompts))]
        p = p[-budget:]
        kind = "bad" if i % 25 == 24 else KINDS[i % len(KINDS)]
        b = {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
        if kind == "bad":
            field, value = BAD[(i // 25) % len(BAD)]
            value = {"context": 2 * max_model_len, "out_of_vocab": p[:8] + [10 ** 9]}.get(value, value)
            b[field] = value
            b["bad_field"] = field
        if kind == "stop":
            b["stop"] = ["\n\n", "."]
        elif kind == "logprobs":
            b["logprobs"] = 2
        elif kind == "temp":
            b.update(temperature=0.7, seed=1000 + i)
        elif kind == "top_p":
            b.update(temperature=1.0, top_p=0.9, seed=1000 + i)
        elif kind == "n2":
            b.update(temperature=0.8, n=2, seed=1000 + i)
        elif kind == "json":
            b["structured_outputs"] = {"json": JSON_SCHEMA}
        elif kind == "drop":
            b["stream"] = True
        bodies.append({"i": i, "kind": kind, "body": b})
    return bodies


async def _one(session, base: str, model: str, req: dict, drop_after: int = 3) -> dict:
    import aiohttp
    body = {k: v for k, v in {**req["body"], "model": model}.items() if k != "bad_field"}
    t0 = time.perf_counter()
    out = {"i": req["i"], "kind": req["kind"]}
    try:
        async with session.post(base + "/v1/completions", json=body) as r:
            if req["kind"] == "drop":        # read a few chunks, then hang up mid-stream
                chunks = 0
                async for line in r.content:
                    chunks += 1
                    if line.startswith(b"data: {") and "id" not in out:
                        out["id"] = json.loads(line[6:])["id"]
                    if chunks >= drop_after:
                        break
                r.close()
                out.update(status=r.status, dropped=True, latency=time.perf_counter() - t0)
                return out
            data = await r.json(content_type=None)
            out.update(status=r.status, latency=time.perf_counter() - t0)
            if r.status != 200:
                out["error"] = str(data)[:300]
                return out
            if req["kind"] == "bad":
                out["error"] = f"accepted a malformed request ({req['body']['bad_field']})"
                return out
            out["id"] = data.get("id")
            ch = sorted(data["choices"], key=lambda c: c["index"])
            out["texts"] = [c["text"] for c in ch]
            out["token_ids"] = [c.get("token_ids") for c in ch]
            if (ch[0].get("logprobs") or {}).get("top_logprobs"):
                out["top_logprobs"] = ch[0]["logprobs"]["top_logprobs"]
            out["tokens"] = data["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.update(status=-1, error=repr(e), latency=time.perf_counter() - t0)
    return out


async def drive(base: str, model: str, reqs: list[dict], concurrency: int, timeout: float) -> tuple[list[dict], float]:
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    bar = _bar(len(reqs))

    async def run(r):
        async with sem:
            res = await _one(session, base, model, r)
            bar.update(1)
            return res
    t0 = time.perf_counter()
    # One connection per request: a pooled keep-alive connection the server has just closed (vLLM's
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s, is shorter than aiohttp's 15 s) fails the next request that
    # picks it up with "Can not write request body", a client race that is not the server's failure.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        out = await asyncio.gather(*(run(r) for r in reqs))
    bar.close()
    return list(out), time.perf_counter() - t0


def _bar(n):
    try:
        from tqdm import tqdm
        return tqdm(total=n, desc="requests", unit="req", leave=False)
    except ImportError:      # pragma: no cover
        class _B:
            def update(self, _): pass
            def close(self): pass
        return _B()


def _get(url: str, timeout: float = 30) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def plugin_state(base: str) -> list[dict]:
    import urllib.request
    req = urllib.request.Request(base + "/collective_rpc", json.dumps({"method": "plugin_state_summary"}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["results"]


def spec_counters(base: str) -> dict:
    """vllm:spec_decode_* counters summed over engines: drafts, draft tokens, accepted, per position."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "preemptions": 0.0, "generated": 0.0, "per_pos": {}}
    names = {"vllm:num_preemptions_total": "preemptions", "vllm:spec_decode_num_drafts_total": "drafts",
             "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted", "vllm:generation_tokens_total": "generated"}
    for line in _get(base + "/metrics").splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[names[name]] += float(line.split()[-1])
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(line.split('position="')[1].split('"')[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + float(line.split()[-1])
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_method(name: str, spec, model: str, reqs: list[dict], a, workdir: Path) -> dict:
    # A token budget that never splits a prompt: vllm-cpu 0.32 kills the engine ("CPU Generator
    # does not use offset") when a seeded request's prefill is chunked, speculation or not.
    args = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.concurrency),
            "--max-num-batched-tokens", str(a.concurrency * a.max_model_len),
            "--enable-prefix-caching"] + (["--enforce-eager"] if a.eager else [])
    if a.kv_blocks:
        args += ["--num-gpu-blocks-override", str(a.kv_blocks)]
    env = {"OMP_NUM_THREADS": str(a.threads), "VLLM_CPU_KVCACHE_SPACE": str(a.kv_space)}
    with Server(model, spec, workdir / f"server_{name}.log", args, env) as srv:
        base_state = plugin_state(srv.base)
        c0 = spec_counters(srv.base)
        res, wall = asyncio.run(drive(srv.base, model, reqs, a.concurrency, a.timeout))
        c1 = spec_counters(srv.base)
        seeded = [r for r in reqs if r["kind"] in SEEDED]
        again, _ = asyncio.run(drive(srv.base, model, seeded, a.concurrency, a.timeout))
        # The runner hears that a request finished at the engine's next step: one 1-token probe
        # makes that step happen, so only the probe's own state may remain afterwards.
        asyncio.run(drive(srv.base, model, [{"i": -1, "kind": "probe", "body": {"prompt": [1, 2, 3], "max_tokens": 1}}],
                          1, 60))
        state = plugin_state(srv.base)
        try:
            _get(srv.base + "/health")
            alive = True
        except Exception:
            alive = False
    bad = [r for r in res if r["kind"] == "bad"]
    res_ok = [r for r in res if r["kind"] != "bad"]
    done = [r for r in res_ok if r.get("status") == 200 and not r.get("dropped")]
    failed = [r for r in res_ok if r.get("status") != 200]
    # a malformed request must get a client error with a message (not 200, not a 5xx / dropped connection)
    rejected = [r for r in bad if 400 <= r.get("status", 0) < 500 and r.get("error")]
    repeat_diff = [{"i": r2["i"], "kind": r2["kind"], "first": res[r2["i"]].get("texts"), "again": r2.get("texts")}
                   for r2 in again if r2.get("texts") != res[r2["i"]].get("texts")]
    repeat_bad = len(repeat_diff)
    drafts = c1["drafts"] - c0["drafts"]
    acc = c1["accepted"] - c0["accepted"]
    per_pos = [(c1["per_pos"].get(p, 0.0) - c0["per_pos"].get(p, 0.0)) / drafts if drafts else 0.0
               for p in sorted(c1["per_pos"])]
    lat = [r["latency"] for r in done]
    return {"method": name, "spec": spec, "requests": len(res), "completed": len(done), "failed": len(failed),
            "failures": [f.get("error") for f in failed][:5], "dropped": sum(1 for r in res if r.get("dropped")),
            "malformed": len(bad), "malformed_rejected": len(rejected),
            "malformed_answers": [(r.get("status"), (r.get("error") or "")[:120]) for r in bad][:6],
            "wall_s": wall, "output_tokens": sum(r["tokens"] for r in done),
            "tok_per_s": sum(r["tokens"] for r in done) / wall, "req_per_s": len(done) / wall,
            "latency_p50": _pct(lat, .5), "latency_p90": _pct(lat, .9), "latency_p99": _pct(lat, .99),
            "tau": tau_of(c1["generated"] - c0["generated"], acc) if drafts else None,
            "per_position_acceptance": per_pos,
            "seeded_repeat_mismatches": repeat_bad, "seeded_repeat_diffs": repeat_diff[:5],
            "preemptions": c1["preemptions"] - c0["preemptions"], "server_alive": alive,
            "plugin_state_before": base_state, "plugin_state_after": state,
            "plugin_bytes_before": _state_bytes(base_state), "plugin_bytes_after": _state_bytes(state), "results": res}


def _state_bytes(state: list[dict]) -> int:
    """Bytes of per-request proposer state held, over workers (methods that can report it)."""
    return sum(w.get("nbytes") or 0 for w in state)


def compare(plain: dict, got: dict) -> int:
    """Greedy responses that differ from plain vLLM's (same request index)."""
    ref = {r["i"]: r for r in plain["results"]}
    bad = 0
    for r in got["results"]:
        if r["kind"] in GREEDY and r.get("status") == 200:
            if r.get("texts") != ref[r["i"]].get("texts"):
                bad += 1
    return bad


def state_back_to_baseline(rep: dict) -> bool:
    """Per worker: at most the probe's own request (and its bytes) left beyond the state held
    before the load."""
    before = {w.get("method"): w for w in rep["plugin_state_before"]}
    for w in rep["plugin_state_after"]:
        b = before.get(w.get("method"), {})
        if w.get("requests", 0) > b.get("requests", 0) + 1:
            return False
        if w.get("requests", 0) > b.get("requests", 0) and (w.get("nbytes") or 0) > 0:
            continue                                   # the probe's own state, freed at the next step
        if (w.get("nbytes") or 0) > (b.get("nbytes") or 0):
            return False
    return True


def table(reports: list[dict]) -> str:
    """Markdown table, one row per method (x plain: output tokens/s over plain vLLM's)."""
    plain = reports[0]["tok_per_s"]
    rows = ["| method | ok | failed | dropped | malformed rejected | tok/s | x plain | p50 s | p99 s | tau | "
            "per-position acceptance | greedy != plain | seeded repeat != | preemptions | plugin state |",
            "|" + "---|" * 15]
    for r in reports:
        pp = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        head = (f"| {r['method']} | {r['completed']} | {r['failed']} | {r['dropped']} | "
                f"{r['malformed_rejected']}/{r['malformed']} | {r['tok_per_s']:.1f} | {r['tok_per_s'] / plain:.2f} | "
                f"{r['latency_p50']:.1f} | {r['latency_p99']:.1f} | ")
        rows.append(head + (f"{r['tau']:.2f} | {pp} | " if r["tau"] else "- | - | "))
        rows[-1] += (f"{r['greedy_mismatches']} | {r['seeded_repeat_mismatches']} | {r['preemptions']:.0f} | "
                     f"{'baseline' if r['state_back_to_baseline'] else 'LEAK'} |")
    return "\n".join(rows) + "\n"


def plot(reports: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["method"] for r in reports]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(names, [r["tok_per_s"] for r in reports], color="tab:blue")
    ax[0].set(ylabel="output tokens/s", title="throughput")
    for q, c in (("latency_p50", "tab:green"), ("latency_p99", "tab:red")):
        ax[1].plot(names, [r[q] for r in reports], "o-", color=c, label=q.split("_")[1])
    ax[1].set(ylabel="request latency (s)", title="latency")
    ax[1].legend()
    for x in ax:
        x.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    from vllm_spec_plugins.tools.models import default_model_dir
    ap = argparse.ArgumentParser(prog="scripts/load.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--methods", default="plain,lookahead,bandit_tree,mamba,cascade",
                    help="comma list from " + ", ".join(METHODS) + " or --method-config names "
                         "(plain is always run first)")
    ap.add_argument("--method-config", action="append", default=[], metavar="NAME=JSON",
                    help="speculative_config for method NAME (a JSON object)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32, help="client concurrency = --max-num-seqs")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-space", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--kv-blocks", type=int, default=0, help="--num-gpu-blocks-override (small: forces preemption)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for all requests of one method")
    ap.add_argument("--out", default="out/load")
    a = ap.parse_args(argv)
    model = a.model or str(default_model_dir())
    methods = dict(METHODS)
    for item in a.method_config:
        name, _, js = item.partition("=")
        if not js:
            ap.error(f"--method-config {item!r}: expected NAME=JSON")
        methods[name] = json.loads(js)
    names = ["plain"] + [m for m in a.methods.split(",") if m and m != "plain"]
    if bad := [m for m in names if m not in methods]:
        ap.error(f"unknown method(s) {bad}; choose from {list(methods)} or give --method-config NAME=JSON")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = workload(model, a.requests, a.max_tokens, a.max_model_len)
    reports = []
    # SIGTERM (a killed run) unwinds through the servers' `with`, which stops them: no orphan server.
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig)) if main_thread else None
    try:
        for name in names:
            print(f"== {name}", flush=True)
            rep = run_method(name, methods[name], model, reqs, a, out)
            rep["greedy_mismatches"] = compare(reports[0], rep) if reports else 0
            rep["state_back_to_baseline"] = state_back_to_baseline(rep)
            reports.append(rep)
    finally:
        if old is not None:    # None: the previous handler was not set from Python (nothing to put back)
            signal.signal(signal.SIGTERM, old)
    print("\n" + table(reports))
    summary = {"args": vars(a), "reports": reports}
    (out / "load.json").write_text(json.dumps(summary, indent=1))
    plot(reports, str(out / "load.png"))
    print(f"wrote {out / 'load.json'} and {out / 'load.png'}")
    (out / "load.md").write_text(table(reports))
    ok = all(r["failed"] == 0 and r["greedy_mismatches"] == 0 and r["seeded_repeat_mismatches"] == 0
             and r["state_back_to_baseline"] and r["malformed_rejected"] == r["malformed"] and r["server_alive"]
             for r in reports)
    return 0 if ok else 1
