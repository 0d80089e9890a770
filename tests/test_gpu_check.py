"""scripts/gpu_check.py, the prepared GPU run, rehearsed on CPU: vLLM's Triton kernel from the
bundle under Triton's interpreter, the cost curve on a tiny Llama, the sm_90 compile of the
kernel variants, and a negative run (a wrong tree mask must be reported)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _need(*mods):
    for m in mods:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    _need("vllm", "triton")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_bundle
    finally:
        sys.path.pop(0)
    dest = gpu_bundle.build(tmp_path_factory.mktemp("bundle") / ".gpu_bundle")
    return dest


def _run(out: Path, bundle: Path, *extra, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), "--bundle", str(bundle), *extra], cwd=str(REPO),
                       env=env, capture_output=True, text=True, timeout=timeout)
    return p


def test_bundle_is_small_and_self_contained(bundle):
    files = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert "vllm/v1/attention/ops/triton_unified_attention.py" in files
    assert "vllm/v1/attention/ops/triton_attention_helpers.py" in files
    assert sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) < 1 << 20
    m = json.loads((bundle / "MANIFEST.json").read_text())
    assert m["vllm"].endswith("0.32.0") and len(m["copied"]) == 2
    # the copies are verbatim
    import hashlib
    for rel, meta in m["copied"].items():
        assert hashlib.sha256(Path(meta["source"]).read_bytes()).hexdigest() == meta["sha256"]
    # no file of the bundle imports a vllm module the bundle does not have
    import ast
    have = {".".join(Path(f).with_suffix("").parts).removesuffix(".__init__") for f in files if f.endswith(".py")}
    for f in files:
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((bundle / f).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                if node.module == "vllm.v1.attention.ops.int4_per_token_head":
                    continue                        # lazy import, INT4 KV caches only
                assert node.module in have, (f, node.module)


def test_quick_rehearsal(tmp_path, bundle):
    """The rehearsal command of docs/gpu.md: every kernel case matches the float32 reference,
    the JSON has what the GPU run must record, the curve's mask is honoured, sm_90 compiles."""
    _need("transformers")
    out = tmp_path / "out"
    p = _run(out, bundle, "--quick", "--interpret")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "===== gpu_check summary =====" in p.stdout

    k = json.loads((out / "kernel_check.json").read_text())
    for key in ("torch", "triton", "transformers", "timestamp", "git", "device"):
        assert key in k["env"], key
    assert k["env"]["git"]["sha"]
    assert k["kernel"]["kernel_file"].startswith(str(bundle.resolve()))
    assert k["all_pass"] is True and k["num_failed"] == 0 and not k["errors"] and not k["skipped"]
    assert len(k["cases"]) >= 4
    kinds = set()
    for c in k["cases"]:
        assert c["pass"], c
        assert c["untouched_rows_ok"]
        assert c["plugin_alone"]["max_abs"] <= c["tolerance"]["abs"]
        assert c["composed"]["rel_l2"] <= c["tolerance"]["rel"]
        assert c["mask_sensitivity_max_abs"] > 10 * c["tolerance"]["abs"]   # a wrong mask would show
        kinds |= {r["kind"] for r in c["requests"]}
        assert {16, 32} >= {c["block_size"]}
    assert kinds == {"tree", "chain", "decode", "causal"}
    assert {c["block_size"] for c in k["cases"]} == {16, 32}
    assert any(r["shared"] for c in k["cases"] for r in c["requests"])
    t = k["timing"]
    assert t and t[0]["status"] == "ok" and t[0]["causal_ms"] > 0 and t[0]["plugin_shared_tree_ms"] > 0

    c = json.loads((out / "cost_curve.json").read_text())
    # the model honours the tree mask, with vLLM's kernel (paged, qq_bias) and with SDPA
    assert set(c["mask_sanity"]) == {"triton", "sdpa"} and c["mask_sanity_pass"], c["mask_sanity"]
    for v in c["mask_sanity"].values():
        assert v["tree_row_vs_chain_path_max_abs"] < 1e-2 < v["causal_row_vs_chain_path_max_abs"]
    assert c["model"]["param_dtypes"] == ["torch.bfloat16"]
    cells = c["cells"]
    assert cells and all(x["status"] == "ok" and x["ms"] > 0 for x in cells), cells
    assert {x["mask"] for x in cells} == {"chain", "tree"}
    assert {x["attn"] for x in cells} == {"triton", "sdpa"}
    assert c["triton_attention_python_calls"] > 0
    assert {x["q_len"] for x in cells if x["attn"] == "sdpa"} >= {1, 4, 16}
    for key in ("torch", "timestamp", "git", "device"):
        assert key in c["env"]

    comp = json.loads((out / "compile_check.json").read_text())
    assert comp["all_ok"], comp["errors"]
    assert comp["target"] == "cuda:90"
    assert all(v["local_bytes"] == 0 for v in comp["variants"] if "local_bytes" in v)


def test_wrong_mask_is_reported(tmp_path, bundle):
    """The check can fail: the kernel gets each tree's transposed mask, the reference the right one."""
    out = tmp_path / "out"
    p = _run(out, bundle, "--quick", "--interpret", "--parts", "kernel", "--no-kernel-timing", "--fault", "mask")
    assert p.returncode == 1, p.stdout[-4000:] + p.stderr[-4000:]
    k = json.loads((out / "kernel_check.json").read_text())
    assert k["all_pass"] is False
    assert k["cases"] and not any(c["pass"] for c in k["cases"])     # every case holds a tree of >= 2 rows
    assert "FAIL" in p.stdout


def test_budget_guard_records_skipped_cells(tmp_path, bundle):
    _need("transformers")
    out = tmp_path / "out"
    p = _run(out, bundle, "--quick", "--parts", "curve", "--budget-s", "1", "--reserve-s", "1")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    c = json.loads((out / "cost_curve.json").read_text())
    assert c["cells"] and all(x["status"] == "skipped_budget" for x in c["cells"])
    assert c["counts"] == {"skipped_budget": len(c["cells"])}


def test_predict_combines_tau_and_step_cost(tmp_path):
    """scripts/predict.py: speedup = tau * step(1) / (step(1 + L) + draft_ms), from the bench's
    own --draft-cost table (chain) and --step-cost ratio (trees), or a gpu_check curve."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import predict
    finally:
        sys.path.pop(0)
    bench = {
        "results": {"plain": {"chat": {"generated_tokens": 64, "accepted": 0, "draft_tokens": 0}},
                    "lookahead": {"chat": {"generated_tokens": 64, "accepted": 24, "draft_tokens": 120,
                                           "speedup_vs_plain": 1.3}},
                    "bandit_tree": {"chat": {"generated_tokens": 64, "accepted": 32, "draft_tokens": 128,
                                             "speedup_vs_plain": 1.2}}},
        "config": {"batch_size": 1, "method_configs": {"plain": None, "lookahead": {"method": "lookahead"},
                                                       "bandit_tree": {"method": "bandit_tree"}}},
        "draft_cost": {"chat": {"0": {"ms": 10.0}, "2": {"ms": 12.0}, "4": {"ms": 14.0}}},
        "step_cost": {"chat": {"tree_over_chain": 1.5}}}
    p = predict.predict(bench, None, "triton", 512, {"lookahead": 1.0})
    rows = {r["method"]: r for r in p["rows"]}
    la = rows["lookahead"]                          # tau 64/40 = 1.6, L = 3 -> q 4 -> 13 ms
    assert la["tau"] == pytest.approx(1.6) and la["step_ms_verify"] == pytest.approx(13.0)
    assert la["predicted_speedup"] == pytest.approx(1.6 * 10 / 14) and not la["upper_bound"]
    assert la["implied_draft_ms"] == pytest.approx(1.6 * 10 / 1.3 - 13)
    bt = rows["bandit_tree"]                        # tau 2, L = 4 -> q 5 -> 14 ms * 1.5 (tree)
    assert bt["tree_cost_used"] and bt["step_ms_verify"] == pytest.approx(21.0)
    assert bt["predicted_speedup"] == pytest.approx(2 * 10 / 21) and bt["upper_bound"]
    curve = {"env": {"device": {"name": "X"}}, "cells": [
        {"attn": "triton", "batch": 1, "ctx": 512, "q_len": q, "mask": m, "ms": ms, "status": "ok"}
        for q, m, ms in ((1, "chain", 6.0), (4, "chain", 6.3), (8, "chain", 6.6), (4, "tree", 6.4),
                         (8, "tree", 6.8))]}
    g = {r["method"]: r for r in predict.predict(bench, curve, "triton", 512, {})["rows"]}
    assert g["lookahead"]["predicted_speedup"] == pytest.approx(1.6 * 6.0 / 6.3)
    assert g["bandit_tree"]["step_ms_verify"] == pytest.approx(6.5)
    assert "measured_speedup" not in g["lookahead"]


def test_documented_device_call():
    """docs/gpu.md's device call: under the tool's 2000 characters, runs this script on $OUT,
    carries the bundle; the rerun variants it names parse."""
    import re
    doc = (REPO / "docs" / "gpu.md").read_text()
    cmd = re.search(r"- `command`:\n  ```\n  (.+)\n  ```", doc).group(1)
    assert len(cmd) < 2000 and 'python3 scripts/gpu_check.py "$OUT"' in cmd and "pipefail" in cmd
    assert '`carry`: `[".gpu_bundle"]`' in doc and "`timeout_s`: `480`" in doc
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    a = gpu_check.parse_args(["/tmp/x"])
    assert a.budget_s + 60 <= 480 and a.parts == ["auto"] and a.curve_attn == ["triton", "sdpa"]
    for extra in (["--parts", "kernel", "--budget-s", "150"], ["--parts", "curve", "--budget-s", "200"]):
        gpu_check.parse_args(["/tmp/x", *extra])
