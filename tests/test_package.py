"""The package as a user gets it: generated docs current, the benchmark page from result JSONs,
`--config NAME` resolution, and a wheel installed in a clean venv serving a packaged drop-in."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from _scripts import load
from test_serve import _free_port, _get, _post, stop

ROOT = Path(__file__).resolve().parents[1]


gen_docs = load("gen_docs")


# ---------------------------------------------------------------- generated docs
def test_generated_docs_are_current():
    """docs/configuration.md's key tables and docs/benchmarks.md's result tables are what
    scripts/gen_docs.py makes from config.py and docs/results/*.json (run it to fix)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_key_tables_cover_every_user_method_and_key():
    from vllm_spec_plugins.config import METHODS, method_keys
    text = gen_docs.render_keys()
    for method in METHODS:
        keys = method_keys(method)
        if method in ("oracle", "adversarial"):
            assert f"### `{method}`" not in text
            continue
        section = text.split(f"### `{method}`", 1)[1].split("### ", 1)[0]
        for name in keys:
            assert f"| `{name}` |" in section, (method, name)
    assert "| `model` | required |" in text          # mamba's drafter folder has no default


def test_no_dated_run_logs():
    """The repository speaks of the project as it is: no "session N" logs in the README, docs
    or code (measured tables belong in docs/benchmarks.md, reasoning in commit messages)."""
    pat = re.compile(r"session [0-9]+", re.I)
    hits = []
    for top in ("README.md", "docs", "vllm_spec_plugins", "proposers", "scorers"):
        p = ROOT / top
        for f in [p] if p.is_file() else p.rglob("*"):
            if f.is_file() and f.suffix in (".md", ".py", ".c", ".yaml", ".json") and "__pycache__" not in f.parts:
                lines = f.read_text(errors="replace").splitlines()
                hits += [f"{f.relative_to(ROOT)}:{i}" for i, line in enumerate(lines, 1) if pat.search(line)]
    assert not hits, hits


def test_readme_is_short_and_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260
    first = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "bash scripts/setup.sh && .venv/bin/vllm-spec serve --config configs/lookahead.yaml" in first
    assert "bash scripts/test.sh" in first


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_local_links_in_readme_and_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and a `#anchor`
    on a markdown page names one of its headings (the README cites benchmark sections by name)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            f = (page.parent / path).resolve()
            if not f.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and f.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read_text(), re.M)}
                if anchor not in heads:
                    broken.append(f"{page.name}: {target}")
    assert not broken, broken


# ---------------------------------------------------------------- benchmark page
BENCH_ARGS = ["--methods", "plain,lookahead", "--categories", "chat,code", "--n-per-category", "2",
              "--batch-size", "8", "--max-tokens", "128", "--dtype", "bfloat16", "--eager", "--warm", "16",
              "--interleave", "1", "--method-config", 'la3={"method":"lookahead","num_speculative_tokens":3}',
              "--json", "docs/results/b8.json"]


def _synthetic_result(bench, **extra) -> dict:
    """A small result in the format scripts/bench.py writes: its own argparse namespace as
    `config`, its own `summarize` for the per-category rows."""
    args = bench.parse_args(BENCH_ARGS)

    def group(tps, tau_steps, accepted, outputs):
        gen = sum(len(o[0]) for o in outputs)
        return {"tokens_per_s": tps, "tau": gen / tau_steps, "drafts": 10, "draft_tokens": 30,
                "accepted": accepted, "accepted_per_pos": [accepted, 0, 0], "generated_tokens": gen,
                "seconds": gen / tps, "outputs": outputs}
    plain = {"groups": {"chat": group(40.0, 6, 0, [[[1, 2, 3]], [[4, 5, 6]]]),
                        "code": group(50.0, 6, 0, [[[7, 8, 9]], [[1, 1, 1]]])}}
    la = {"groups": {"chat": group(60.0, 4, 2, [[[1, 2, 3]], [[4, 5, 6]]]),
                     "code": group(55.0, 3, 3, [[[7, 8, 9]], [[1, 1, 2]]])}}
    results = {"plain": bench.summarize(plain, plain, True), "lookahead": bench.summarize(la, plain, True)}
    results["lookahead"]["code"]["mismatch_analysis"] = [{"prompt": 1, "first_diff_token": 2,
                                                          "top2_margin": 0.25, "kind": "near-tie"}]
    out = {"results": results,
           "config": vars(args) | {"model": "/home/u/.cache/vllm_spec_plugins/smollm2-135m-instruct",
                                   "method_configs": {
                                       "plain": None,
                                       "lookahead": {"method": "lookahead", "num_speculative_tokens": 6}},
                                   "n_prompts": {"chat": 2, "code": 2}},
           "machine": {"platform": "Linux-6.1-x86_64", "cpus": 2, "python": "3.11.7"}}
    out.update(extra)
    return out


def test_benchmarks_page_from_a_synthetic_result(tmp_path):
    bench = load("bench")
    (tmp_path / "b8.json").write_text(json.dumps(_synthetic_result(bench)))
    text = gen_docs.render_results(str(tmp_path))
    assert "## `b8`" in text
    # the command, rebuilt from the recorded arguments, parses back to the same arguments
    cmd = text.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert shlex.split(cmd)[:2] == ["python", "scripts/bench.py"]
    assert vars(bench.parse_args(shlex.split(cmd)[2:])) == vars(bench.parse_args(BENCH_ARGS))
    assert "(command rebuilt from the arguments the JSON records)" in text
    assert "code version: not recorded" in text
    assert "CPU model not recorded" in text and "CPU flags not recorded" in text
    assert "batch size: 8" in text and "answer length: 128 tokens" in text
    assert "cold/warm: **warm**: each engine first served 16 training prompts per category" in text
    assert "chat 2, code 2" in text
    # method x category: tokens/s vs plain and tau; plain's own tokens/s; lossless column
    assert "| `plain` | 1.00x (40.0 tok/s) | 1.00 | 1.00x (50.0 tok/s) | 1.00 | - |" in text
    assert "| `lookahead` | 1.50x | 1.50 | 1.10x | 2.00 | differs: 1 near-tie |" in text


def test_benchmarks_page_names_the_host_and_code_version_when_recorded(tmp_path):
    bench = load("bench")
    res = _synthetic_result(bench, command="python scripts/bench.py --methods plain,lookahead",
                            git_sha="0123abc")
    res["machine"] |= {"cpu_model": "AMD EPYC 9R14", "cpu_flags": "fpu avx2 avx512f avx512_bf16 sse4_2 ht"}
    res["config"]["warm"] = 0
    res["results"]["plain"]["chat"]["tokens_per_s_first_last"] = [39.0, 41.0]
    (tmp_path / "cold.json").write_text(json.dumps(res))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "something else"}))
    text = gen_docs.render_results(str(tmp_path))
    assert "python scripts/bench.py --methods plain,lookahead\n```" in text
    assert "(command rebuilt" not in text.split("## `other`")[0]
    assert "code version: `0123abc`" in text
    assert "CPU AMD EPYC 9R14" in text and "flags: avx2 avx512_bf16 avx512f sse4_2" in text
    assert "cold/warm: **cold**: no warm-up" in text
    assert "| `plain` | 1.00x (40.0 tok/s; first / last run 39.0 / 41.0) |" in text
    assert "## `other`" in text and "not rendered" in text
    res["config"] |= {"lockstep": True, "interleave": 0}      # two plain engines side by side
    (tmp_path / "cold.json").write_text(json.dumps(res))
    text = gen_docs.render_results(str(tmp_path))
    assert "| `plain` | 1.00x (40.0 tok/s; two engines 39.0 / 41.0) |" in text
    assert "(`--lockstep 1`)" in text and "plain against plain is the noise left" in text
    assert "Mean request latency" not in text                   # not measured: no table
    for name, lat in (("plain", 2.0), ("lookahead", 1.6)):
        res["results"][name]["chat"] |= {"mean_request_s": lat, "latency_vs_plain": 2.0 / lat}
    (tmp_path / "cold.json").write_text(json.dumps(res))
    text = gen_docs.render_results(str(tmp_path))
    assert "| `plain` | 1.00x (2.00) |" in text and "| `lookahead` | 1.25x (1.60) |" in text


def test_benchmarks_page_without_results(tmp_path):
    assert "No benchmark results are committed yet" in gen_docs.render_results(str(tmp_path))
    assert "No result here measured `--draft-cost` yet" in gen_docs.render_pays(str(tmp_path))


def test_when_speculation_pays_from_draft_cost_runs(tmp_path):
    """One row per result with `--draft-cost`: its host's ISA, the median price of L drafts over
    categories, and per category the fastest of our served methods beside vLLM's suffix."""
    bench = load("bench")
    res = _synthetic_result(bench)
    res["machine"] |= {"cpu_model": "AMD EPYC 7B13", "cpu_flags": "fpu avx2 fma"}
    res["git"] = {"sha": "0123456789abcdef"}
    res["draft_cost"] = {c: {"0": {"ms": 30.0, "x_no_draft": 1.0}, "1": {"ms": 47.0, "x_no_draft": x1},
                             "4": {"ms": 95.0, "x_no_draft": x4}}
                         for c, x1, x4 in (("chat", 1.5, 3.0), ("code", 1.7, 3.4))}
    res["results"]["suffix"] = {"chat": {"speedup_vs_plain": 0.9}, "code": {"speedup_vs_plain": 1.25}}
    (tmp_path / "avx2.json").write_text(json.dumps(res))
    (tmp_path / "no_cost.json").write_text(json.dumps(_synthetic_result(bench)))
    text = gen_docs.render_pays(str(tmp_path))
    rows = [r for r in text.splitlines() if r.startswith("| [")]
    assert len(rows) == 1
    assert rows[0].startswith("| [`avx2`](#avx2) | `0123456` | avx2 (AMD EPYC 7B13) | bfloat16 | 8 | 45.0 |")
    assert "1.60x / 3.20x (L = 1, 4)" in rows[0]
    assert "chat: 1.50x `lookahead` (`suffix` 0.90x); code: 1.10x `lookahead` (`suffix` 1.25x)" in rows[0]


def test_served_defaults_table_from_all_seven_runs(tmp_path):
    """One row per cold fresh-prompt run of every served method at bench.py's own configs: x plain
    per category (tau for lookahead and suffix) and the two plain engines' spread; a run whose
    --method-config reconfigures one of them, or without every method, is left out (one that only
    adds a method beside them is kept)."""
    bench = load("bench")
    res = _synthetic_result(bench)
    res["config"] |= {"prompt_source": "fresh", "cold": True, "method_config": None}
    res["git"] = {"sha": "0123456789abcdef"}
    res["results"]["plain"]["chat"]["tokens_per_s_first_last"] = [39.0, 41.0]
    for i, m in enumerate(gen_docs.SERVED_TABLE):
        res["results"][m] = {c: {"speedup_vs_plain": 1.0 + i / 10 + j / 100, "tau": 1.5 + j} for j, c in
                             enumerate(("chat", "code"))}
    (tmp_path / "all.json").write_text(json.dumps(res))
    (tmp_path / "tuned.json").write_text(json.dumps(res | {"config": res["config"] | {
        "method_config": ['lookahead={"method": "lookahead", "num_speculative_tokens": 4}']}}))
    (tmp_path / "more.json").write_text(json.dumps(res | {"config": res["config"] | {"method_config": ["x={}"]}}))
    partial = json.loads(json.dumps(res))
    del partial["results"]["ngram"]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    text = gen_docs.render_served(str(tmp_path))
    rows = [r for r in text.splitlines() if r.startswith("| [")]
    assert len(rows) == 2 and rows[0].startswith("| [`all`](#all) | `0123456` | ")
    assert rows[1].startswith("| [`more`](#more) | `0123456` | ")
    assert "| 2 / 2 | 5.0 / -% | 1.00 / 1.01 (tau 1.50 / 2.50) | 1.10 / 1.11 |" in rows[0]
    assert rows[0].endswith("| 1.40 / 1.41 (tau 1.50 / 2.50) | 1.50 / 1.51 |")
    assert "No result here ran every served method" in gen_docs.render_served(str(tmp_path / "none"))


# ---------------------------------------------------------------- --config NAME
def test_config_by_name_resolves_to_the_packaged_dropin(tmp_path, monkeypatch):
    from vllm_spec_plugins import cli
    monkeypatch.chdir(tmp_path)
    shipped = cli.packaged_configs()
    assert {"lookahead", "mamba_smollm2", "bandit_tree"} <= set(shipped)
    for name in ("lookahead", "lookahead.yaml"):
        path = cli.resolve_config(name)
        assert path == shipped["lookahead"] and Path(path).is_file()
    argv = cli._default_model_if_missing(["vllm-spec", "serve", "M", "--config=mamba_smollm2", "--port", "1"])
    assert argv == ["vllm-spec", "serve", "M", "--config=" + shipped["mamba_smollm2"], "--port", "1"]
    own = tmp_path / "lookahead"            # an existing file wins over a packaged name
    own.write_text("speculative-config: {method: lookahead}\n")
    assert cli.resolve_config("lookahead") == "lookahead"
    with pytest.raises(SystemExit, match="no packaged drop-in.*packaged: .*lookahead"):
        cli.resolve_config("no_such_dropin")
    with pytest.raises(SystemExit, match="no such file"):
        cli.resolve_config("missing/lookahead.yaml")


# ---------------------------------------------------------------- the wheel, in a clean venv
SOURCES = ("setup.py", "README.md", "LICENSE", "MANIFEST.in", "vllm_spec_plugins", "proposers", "scorers", "configs")


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_wheel_in_a_clean_venv_serves_a_packaged_dropin(tmp_path):
    """`pip install` of the built wheel (not editable) gives the CLI, the shipped drafters and the
    YAML drop-ins; `vllm-spec serve --config lookahead` from an unrelated folder serves with it."""
    src = tmp_path / "src"        # a copy: a stale build/ in the checkout must not leak into the wheel
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        elif p.exists():
            shutil.copy2(p, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp_path / "dist"), str(src)], cwd=src)
    wheel, = (tmp_path / "dist").glob("vllm_spec_plugins-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    # vLLM, torch, ... from this venv's site-packages, listed in a .pth: appended to sys.path, but
    # .pth files inside it are not processed, so its editable install of this package stays off.
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "main_venv.pth").write_text("\n".join(sorted(here)) + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)])

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    probe = _run([str(py), "-c",
                  "import json, vllm_spec_plugins as p; from importlib.resources import files; "
                  "from vllm_spec_plugins.tools.drafters import shipped_drafter as d; "
                  "print(json.dumps([p.__file__, sorted(x.name for x in files('vllm_spec_plugins.configs').iterdir()), "
                  "str(d('smollm2-135m-instruct-mamba')), str(d('smollm2-135m-instruct-eagle'))]))"],
                 cwd=cwd, env=env)
    init, configs, *drafters = json.loads(probe.strip().splitlines()[-1])
    assert Path(init).is_relative_to(site), f"imported {init}, not the wheel's copy under {site}"
    assert {"lookahead.yaml", "mamba_smollm2.yaml", "bandit_tree.yaml"} <= set(configs)
    for d in drafters:
        assert Path(d).is_relative_to(site) and (Path(d) / "model.safetensors").stat().st_size > 1e6
    assert (site / "vllm_spec_plugins" / "csrc" / "tree_attention.c").is_file()

    port = _free_port()
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([str(venv / "bin" / "vllm-spec"), "serve", "--config", "lookahead",
                             "--port", str(port), "--enforce-eager"],
                            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 360
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                _get(base + "/health")
                break
            except Exception:
                assert time.time() < deadline, "server did not come up:\n" + log_path.read_text()[-4000:]
                time.sleep(2)
        model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
        r = _post(base + "/v1/completions", {"model": model, "prompt": "def fib(n):",
                                              "max_tokens": 8, "temperature": 0})
        assert r["choices"][0]["text"].strip(), r
        assert "vllm:spec_decode" in _get(base + "/metrics")
    finally:
        stop(proc)
        log.close()


def test_gpu_section_from_a_gpu_check_run(tmp_path):
    """docs/benchmarks.md's GPU section: per run folder, the device and code version, the kernel
    cases that passed, and the cost of q query tokens per request against q = 1."""
    assert "No GPU run is committed yet" in gen_docs.render_gpu(str(tmp_path))
    env = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "git": {"sha": "0123456789abcdef"},
           "argv": ["scripts/gpu_check.py", "/root/out"], "timestamp": "2026-01-02T03:04:05",
           "torch": "2.11", "triton": "3.6.0", "transformers": "5.17.0"}
    case = {"dtype": "bfloat16", "block_size": 16, "num_heads": 32, "num_kv_heads": 8, "head_size": 128,
            "plugin_alone": {"rel_l2": 2e-3}, "composed": {"rel_l2": 1e-3}}
    cells = [{"attn": "triton", "mask": m, "batch": 8, "ctx": 512, "q_len": q, "ms": ms, "status": "ok"}
             for m, q, ms in (("chain", 1, 10.0), ("chain", 2, 10.5), ("chain", 16, 12.0), ("tree", 16, 12.6))]
    cells.append({"attn": "triton", "mask": "chain", "batch": 64, "ctx": 8192, "q_len": 1, "status": "skipped_memory"})
    run = tmp_path / "h100-x"
    run.mkdir()
    (run / "kernel_check.json").write_text(json.dumps({"env": env, "cases": [case, case], "num_cases": 2,
                                                       "num_failed": 0, "timing": []}))
    (run / "cost_curve.json").write_text(json.dumps({"env": env, "cells": cells, "counts": {"skipped_memory": 1},
                                                     "model": {"params": 8.03e9, "shape": {"num_hidden_layers": 32}}}))
    text = gen_docs.render_gpu(str(tmp_path))
    assert "### `h100-x`: NVIDIA H100 80GB HBM3" in text and "at `0123456`" in text
    assert "2 of 2 random batches pass" in text and "worst relative error 2.0e-03" in text
    assert "| 8 | 512 | 10.00 | 1.05x | - | - | 1.20x | - | - | 1.05-1.05 |" in text
    assert "1 cells did not fit the GPU's memory and were skipped (batch 64 at context 8192)" in text
