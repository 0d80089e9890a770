"""vLLM's own client (`vllm bench serve`) against the real server, one speculative method at a time,
on the prompts of scripts/bench.py.

    python scripts/serve_bench.py --methods plain,suffix,lookahead --prompts fresh --n-per-category 6 \
        --max-tokens 128 --dtype bfloat16 --json docs/results/serve_fresh_b1_bf16_cold_avx512.json

For each method: start `vllm-spec serve` (MODEL, --dtype, --max-num-seqs = --batch-size, a free
port, and the method's --speculative-config from scripts/bench.py's table, so a name means the
same config in both), wait for /health, then for each category run

    vllm-spec bench serve --backend openai --base-url URL --dataset-name custom --dataset-path CAT.jsonl
        --skip-chat-template --custom-output-len L --disable-shuffle --no-oversample --num-prompts N
        --max-concurrency B --temperature T --extra-body '{"add_special_tokens": false}' --save-result ...

and stop the server (its process group). The dataset files hold bench.py's prompt rows (same
loader, same de-duplication), each rendered with the model's chat template exactly as bench.py's
engines render them (add_generation_prompt, no extra special tokens), so both see the same tokens.
vLLM reads a `custom` (JSONL) dataset with pandas, which only its `bench` extra installs; without
pandas (--dataset auto) the same texts go in a `sharegpt` JSON file (`--dataset-name sharegpt
--sharegpt-output-len L`), which vLLM reads with `json` and sends unchanged: the requests are the same.

Cold: the server's first requests are the measured ones. `vllm bench serve` sends no warm-up
request by default (--num-warmups 0; its "initial test run" is only sent with
--ready-check-timeout-sec > 0, which is left at 0); the JSON records the server's request count
(vllm:request_success_total) just before the first category, which is 0 on a cold server.

The JSON (small: no per-request arrays) records the host (bench.py's host record), the git commit,
the command line, and per method x category: output tokens/s, mean/median TTFT and TPOT, vLLM's
spec-decode acceptance rate / acceptance length / per-position acceptance as `bench serve` reports
them, speedup vs plain, and (greedy) how many answers are the same text as plain's.
Render it into docs/benchmarks.md with scripts/gen_docs.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIND = "vllm bench serve"
DEFAULT_METHODS = "plain,suffix,lookahead"
# the keys of `vllm bench serve`'s saved result kept per method x category (ms, tokens, seconds)
SUMMARY_KEYS = {
    "output_throughput": "output_tokens_per_s", "mean_ttft_ms": "mean_ttft_ms",
    "median_ttft_ms": "median_ttft_ms", "mean_tpot_ms": "mean_tpot_ms", "median_tpot_ms": "median_tpot_ms",
    "mean_itl_ms": "mean_itl_ms", "completed": "completed", "failed": "failed",
    "total_input_tokens": "total_input_tokens", "total_output_tokens": "total_output_tokens",
    "duration": "duration_s",
    "spec_decode_acceptance_rate": "acceptance_rate_pct", "spec_decode_acceptance_length": "acceptance_length",
    "spec_decode_num_drafts": "drafts", "spec_decode_draft_tokens": "draft_tokens",
    "spec_decode_accepted_tokens": "accepted_tokens",
    "spec_decode_per_position_acceptance_rates": "acceptance_per_position",
}


def load_bench():
    """scripts/bench.py as a module (its method table, prompt loader and host record)."""
    spec = importlib.util.spec_from_file_location("bench", os.path.join(REPO, "scripts", "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = load_bench()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of scripts/bench.py's method names (" + ", ".join(bench.DEFAULT_CONFIGS)
                        + ") or of --method-config names")
    p.add_argument("--method-config", action="append", default=[], metavar="NAME=JSON",
                   help="speculative_config for NAME (JSON object, or 'null' for plain)")
    p.add_argument("--prompts", default="fresh", help="as scripts/bench.py's --prompts (default: fresh)")
    p.add_argument("--n-per-category", type=int, default=6, help="prompts per category (0 = all)")
    p.add_argument("--categories", default=None, help="comma list (default: every category of --prompts)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length (bench serve's --custom-output-len)")
    p.add_argument("--dataset", default="auto", choices=["auto", "custom", "sharegpt"],
                   help="bench serve's dataset loader for the prompt file: custom (JSONL, needs pandas: vLLM's "
                        "`bench` extra) or sharegpt (JSON, no extra package); auto: custom where pandas is "
                        "installed. Both send the same text to /v1/completions")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=1, help="server --max-num-seqs and client --max-concurrency")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plain-rerun", action="store_true",
                   help="measure plain once (default: first and last, tokens/s averaged: the machine drifts)")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a server to answer /health")
    p.add_argument("--raw-dir", default=None,
                   help="keep the dataset files, bench serve's own result JSONs and the server logs here "
                        "(default: a temporary folder, removed)")
    p.add_argument("--json", default="serve_bench.json", help="output JSON")
    return p.parse_args(argv)


# ------------------------------------------------------------------ prompts
def category_rows(args) -> dict:
    """{category: rows}: scripts/bench.py's own loader and de-duplication."""
    ns = argparse.Namespace(prompts=args.prompts, categories=args.categories, n_per_category=args.n_per_category)
    return bench.group_rows(bench.load_rows(ns))[0]


def prompt_text(tokenizer, row) -> str:
    """The text bench.py's engines tokenize for a row (vllm_spec_plugins.tools.runner.to_token_prompts):
    the chat template with the generation prompt for `messages`, else the row's `prompt`."""
    if isinstance(row, str):
        return row
    if "messages" in row:
        return tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    return row["prompt"]


def dataset_name(choice: str = "auto") -> str:
    """custom (vLLM's loader reads JSONL with pandas) where pandas is installed, else sharegpt."""
    if choice != "auto":
        return choice
    return "custom" if importlib.util.find_spec("pandas") is not None else "sharegpt"


def dataset_file(name: str, category: str) -> str:
    return f"{category}.jsonl" if name == "custom" else f"{category}.json"


def write_dataset(path: str, texts: list[str], name: str = "custom") -> str:
    """The prompt file of `--dataset-name NAME`: custom, one {"prompt": text} per line; sharegpt,
    a JSON list of one-turn conversations (the empty answer is never used: the answer length
    is given)."""
    with open(path, "w", encoding="utf-8") as f:
        if name == "custom":
            for t in texts:
                f.write(json.dumps({"prompt": t}, ensure_ascii=False) + "\n")
        else:
            json.dump([{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": ""}]}
                       for t in texts], f, ensure_ascii=False, indent=0)
    return path


def check_sharegpt_lengths(prompt_lens: list[int], max_tokens: int) -> None:
    """vLLM's sharegpt loader silently skips a prompt of < 4 or > 1024 tokens, or > 2048 with its
    answer: refuse such a prompt set rather than measure fewer prompts."""
    bad = [n for n in prompt_lens if n < 4 or n > 1024 or n + max_tokens > 2048]
    if bad:
        raise SystemExit(f"prompts of {bad} tokens: vLLM's sharegpt loader would skip them; "
                         f"install pandas (vLLM's `bench` extra) and use --dataset custom")


# ------------------------------------------------------------------ commands
def vllm_spec() -> list[str]:
    """This environment's `vllm-spec` (next to this Python), else `python -m vllm_spec_plugins`."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-spec")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm_spec_plugins"]


def serve_argv(model: str, spec, port, args) -> list[str]:
    argv = ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
            "--max-num-seqs", str(args.batch_size), "--max-model-len", str(args.max_model_len),
            "--seed", str(args.seed)]
    spec, engine = bench.engine_split(spec)
    for key, value in engine.items():          # a config's engine arguments: vLLM's own flags
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


def bench_argv(base_url: str, model: str, dataset: str, n: int, out_dir: str, out_name: str, args,
               name: str = "custom") -> list[str]:
    """`bench serve` over one category's prompt file: in file order (--disable-shuffle), each once
    (--no-oversample), the text as written (custom: --skip-chat-template; sharegpt applies none),
    tokenized by the server without special tokens, as bench.py's engines do."""
    fmt = (["--dataset-name", "custom", "--dataset-path", dataset, "--skip-chat-template",
            "--custom-output-len", str(args.max_tokens)] if name == "custom" else
           ["--dataset-name", "sharegpt", "--dataset-path", dataset, "--sharegpt-output-len", str(args.max_tokens)])
    return ["bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", model, *fmt,
            "--disable-shuffle", "--no-oversample", "--num-prompts", str(n),
            "--max-concurrency", str(args.batch_size), "--temperature", str(args.temperature),
            "--extra-body", json.dumps({"add_special_tokens": False}), "--seed", str(args.seed),
            "--save-result", "--save-detailed", "--result-dir", out_dir, "--result-filename", out_name]


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def prom_sum(text: str, name: str) -> float | None:
    """Sum over label sets of one Prometheus metric (None if absent)."""
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)]
    return sum(vals) if vals else None


class Server:
    """`vllm-spec serve` in its own process group; `stop` ends the API server and engine core."""

    def __init__(self, argv: list[str], env: dict, log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(vllm_spec() + argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def wait_healthy(self, base_url: str, timeout: float) -> float:
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http_get(base_url + "/health")
                return time.perf_counter() - t0
            except Exception:
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"server did not answer /health in {timeout:.0f} s:\n{self.tail()}")
                time.sleep(1)

    def stop(self) -> None:
        from vllm_spec_plugins.tools.load import stop_group
        stop_group(self.proc, 60)
        self.log.close()


# ------------------------------------------------------------------ results
def summarize_run(res: dict) -> dict:
    """The small per-category record of one `vllm bench serve` result dict (its saved JSON):
    throughput, latencies, vLLM's spec-decode acceptance; no per-request arrays."""
    out = {}
    for src, dst in SUMMARY_KEYS.items():
        if res.get(src) is not None:
            v = res[src]
            out[dst] = ([round(float(x), 4) for x in v] if isinstance(v, list)
                        else round(v, 4) if isinstance(v, float) else v)
    texts = res.get("generated_texts")
    if texts is not None:
        out["_texts"] = list(texts)       # for the comparison with plain; dropped before writing
    return out


def add_vs_plain(results: dict, greedy: bool) -> dict:
    """speedup_vs_plain per method x category (plain's tokens/s: the mean of its first and last
    runs when both exist), and (greedy) same_text_as_plain: answers equal to plain's, as text."""
    plain = results.get("plain") or {}
    for method, cats in results.items():
        for cat, row in cats.items():
            p = plain.get(cat) or {}
            base = p.get("output_tokens_per_s")
            row["speedup_vs_plain"] = round(row["output_tokens_per_s"] / base, 4) if base else None
            if greedy and method != "plain" and "_texts" in row and "_texts" in p:
                row["same_text_as_plain"] = sum(a == b for a, b in zip(row["_texts"], p["_texts"]))
    for cats in results.values():
        for row in cats.values():
            row.pop("_texts", None)
    return results


def merge_plain_rerun(first: dict, again: dict) -> dict:
    """plain's rows with output tokens/s = the mean of its first and last runs (both kept)."""
    for cat, row in first.items():
        if cat in again:
            a, b = row["output_tokens_per_s"], again[cat]["output_tokens_per_s"]
            row["output_tokens_per_s_first_last"] = [a, b]
            row["output_tokens_per_s"] = (a + b) / 2
    return first


def print_table(results: dict, cats: list) -> None:
    print("\n| method | " + " | ".join(f"{c}: tok/s (x plain) | {c}: acc. length" for c in cats) + " |")
    print("|---|" + "---|---|" * len(cats))
    for method, rows in results.items():
        cells = []
        for c in cats:
            r = rows.get(c)
            if not r:
                cells += ["-", "-"]
                continue
            sp = r.get("speedup_vs_plain")
            cells.append(f"{r['output_tokens_per_s']:.1f} ({sp:.2f}x)" if sp else f"{r['output_tokens_per_s']:.1f}")
            al = r.get("acceptance_length")
            cells.append(f"{al:.2f}" if al is not None else "-")
        print(f"| {method} | " + " | ".join(cells) + " |")


def command_line(argv: list | None) -> list:
    args = sys.argv[1:] if argv is None else list(argv)
    return [sys.executable, os.path.relpath(os.path.abspath(__file__), os.getcwd())] + [str(a) for a in args]


# ------------------------------------------------------------------ main
def run_method(name: str, spec, model: str, texts: dict, args, raw_dir: str, env: dict, log,
               ds: str = "custom") -> dict:
    """Serve `spec`, run bench serve once per category (cold: no request before the first),
    stop the server. Returns {"startup_s", "requests_before", "categories": {cat: summary}}."""
    from vllm_spec_plugins.tools.load import free_port
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    server = Server(serve_argv(model, spec, port, args), env, os.path.join(raw_dir, f"{tag}.server.log"))
    try:
        log(f"[{name}] starting server on port {port}")
        startup = server.wait_healthy(base_url, args.start_timeout)
        inactive = [ln for ln in server.tail(10**6).splitlines() if "vllm-spec-plugins" in ln and "inactive" in ln]
        if inactive:       # plain vLLM would serve: not the code this benchmark is about
            raise RuntimeError(f"the plugin did not load in the server: {inactive[0]}")
        before = prom_sum(http_get(base_url + "/metrics"), "vllm:request_success_total")
        log(f"[{name}] up after {startup:.0f} s; requests served so far: {before}")
        out = {"startup_s": round(startup, 1), "requests_before": before, "categories": {}}
        for cat, cat_texts in texts.items():
            dataset = os.path.join(raw_dir, dataset_file(ds, cat))
            res_name = f"{tag}.{cat}.json"
            cmd = vllm_spec() + bench_argv(base_url, model, dataset, len(cat_texts), raw_dir, res_name, args, ds)
            log(f"[{name}] {cat}: {len(cat_texts)} prompts")
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            with open(os.path.join(raw_dir, f"{tag}.{cat}.bench.log"), "w") as f:
                f.write(p.stdout + p.stderr)
            if p.returncode != 0:
                raise RuntimeError(f"bench serve failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
            if "Warming up" in p.stdout or "Initial test run completed" in p.stdout:
                raise RuntimeError("bench serve sent a request before the measured ones: not cold")
            with open(os.path.join(raw_dir, res_name)) as f:
                row = summarize_run(json.load(f))
            if row.get("completed") != len(cat_texts):
                raise RuntimeError(f"bench serve completed {row.get('completed')} of {len(cat_texts)} requests")
            out["categories"][cat] = row
            al = row.get("acceptance_length")
            log(f"[{name}] {cat}: {row['output_tokens_per_s']:.1f} tok/s, mean TPOT {row['mean_tpot_ms']:.1f} ms"
                + (f", acceptance length {al:.2f}" if al is not None else "")
                + f" ({time.perf_counter() - t0:.0f} s)")
        return out
    finally:
        server.stop()


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    from tqdm import tqdm

    command = command_line(argv)
    host, git = bench.host_record(), bench.git_state()
    model = args.model
    if model is None:
        from vllm_spec_plugins.tools.models import build_default_model
        model = str(build_default_model())
    bench_args = argparse.Namespace(methods=args.methods, method_config=args.method_config, fixed_budget=False,
                                    step_cost=0, draft_cost="", sweep=[])
    configs = bench.method_configs(bench_args, model)        # bench.py's table; plain first
    groups = category_rows(args)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    texts = {cat: [prompt_text(tok, r) for r in rows] for cat, rows in groups.items()}
    from vllm_spec_plugins.tools.runner import to_token_prompts
    lens = {cat: [len(p) for p in to_token_prompts(tok, rows)] for cat, rows in groups.items()}
    prompt_tokens = {cat: sum(v) for cat, v in lens.items()}
    ds = dataset_name(args.dataset)
    if ds == "sharegpt":
        check_sharegpt_lengths([n for v in lens.values() for n in v], args.max_tokens)

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs = list(configs.items()) + ([] if args.no_plain_rerun else [("plain (again)", None)])
    keep = args.raw_dir is not None
    raw_dir = args.raw_dir or tempfile.mkdtemp(prefix="serve_bench_")
    os.makedirs(raw_dir, exist_ok=True)
    for cat, t in texts.items():
        write_dataset(os.path.join(raw_dir, dataset_file(ds, cat)), t, ds)
    raw = {}
    try:
        bar = tqdm(runs, desc="servers", unit="server")
        for name, spec in bar:
            bar.set_postfix_str(name)
            raw[name] = run_method(name, spec, model, texts, args, raw_dir, env, tqdm.write, ds)
    finally:
        if not keep:
            import shutil
            shutil.rmtree(raw_dir, ignore_errors=True)
    again = raw.pop("plain (again)", None)
    results = {name: r["categories"] for name, r in raw.items()}
    if again is not None:
        merge_plain_rerun(results["plain"], again["categories"])
    add_vs_plain(results, args.temperature == 0.0)
    first_cat = next(iter(texts))
    out = {"kind": KIND, "results": results,
           "command": shlex.join(command), "argv": command, "cwd": os.getcwd(), "git": git,
           "config": {k: v for k, v in vars(args).items()} | {
               "model": model, "method_configs": configs,
               "prompt_source": args.prompts, "n_prompts": {c: len(g) for c, g in groups.items()},
               "prompt_ids": {c: [r.get("id") for r in g] for c, g in groups.items()},
               "prompt_tokens": prompt_tokens, "dataset_name": ds,
               "cold": True, "warmup_requests": 0, "ready_check": False,
               "server_commands": {name: shlex.join(["vllm-spec"] + serve_argv(model, spec, "PORT", args))
                                   for name, spec in configs.items()},
               "bench_command": shlex.join(["vllm-spec"] + bench_argv(
                   "http://127.0.0.1:PORT", model, dataset_file(ds, first_cat), len(texts[first_cat]), "DIR",
                   "METHOD.CATEGORY.json", args, ds)),
               "plain_runs": 1 if args.no_plain_rerun else 2},
           "machine": host | {"server_env": {"OMP_NUM_THREADS": str(args.threads)}},
           "startup_s": {name: r["startup_s"] for name, r in raw.items()},
           "requests_before_measuring": {name: r["requests_before"] for name, r in raw.items()}}
    if again is not None:
        out["startup_s"]["plain (again)"] = again["startup_s"]
        out["requests_before_measuring"]["plain (again)"] = again["requests_before"]
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nhost: {host['cpu_model']} ({host['isa']}; {host['cpus']} CPUs); vLLM {host['versions']['vllm']}; "
          f"git {git['sha'][:10] + (' (dirty)' if git['dirty'] else '') if git else '?'}")
    print_table(results, list(texts))
    print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()
