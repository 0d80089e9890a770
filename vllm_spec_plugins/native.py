"""The C kernels (csrc/tree_attention.c, csrc/mamba_step.c), built once per machine and loaded with ctypes.

`library()` (tree attention) and `mamba_step()` compile their source with the system C compiler
(`$CC`, else cc/gcc; -O3 -march=native) into the plugin's cache folder, keyed by source, flags,
compiler and CPU flags, so each worker process of a machine loads the same file and a shared home
folder never hands one CPU's build to another.
It returns None when no compiler is found, the build fails (one warning), or
VLLM_SPEC_PLUGINS_NATIVE=0: `tree_attention.cpu_tree_attention` and the Mamba drafter then run
their torch paths, which compute the same thing more slowly.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("vllm_spec_plugins")

SRC = Path(__file__).parent / "csrc" / "tree_attention.c"
MAMBA_SRC = Path(__file__).parent / "csrc" / "mamba_step.c"
FLAGS = ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC")
ENV = "VLLM_SPEC_PLUGINS_NATIVE"

_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                          # query, strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]       # key/value cache, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                        # out, strides
    + [ctypes.c_void_p, ctypes.c_int64]                                        # block table, stride
    + [ctypes.c_int] + [ctypes.c_void_p] * 7                                   # nreq, req .. mask_off, row0
    + [ctypes.c_int] * 4 + [ctypes.c_float] + [ctypes.c_int] * 2               # H, Hkv, D, bs, scale, dtype, layout
    + [ctypes.c_void_p, ctypes.c_void_p])                                      # k_off, v_off


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform
        return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: Path | None = None, source: Path = SRC) -> Path:
    """Compile `source` (if not built yet) and return the shared library's path."""
    from vllm_spec_plugins.tools.models import cache_root
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    src = Path(source).read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), cc.encode(), _cpu_flags().encode()]))
    out_dir = Path(out_dir) if out_dir else cache_root() / "native"
    lib = out_dir / f"{Path(source).stem}-{key.hexdigest()[:16]}.so"
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(out_dir)
    if lib.exists():
        check_private(lib)
        return lib
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        p = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{cc} failed: {p.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)            # atomic: concurrent workers each build, one file wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def check_private(path: Path) -> None:
    """A library we load runs inside vLLM: its folder and file must be ours and writable by no
    one else, or another user could swap in code."""
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): "
                           "refusing to load native code from it")
    if st.st_mode & 0o022:
        raise RuntimeError(f"{path} is writable by group or others (mode {st.st_mode & 0o777:o}): "
                           "refusing to load native code from it (chmod go-w, or remove it)")


def _load(source: Path, name: str, argtypes, what: str):
    """Function `name` of `source`'s build, or None (disabled, no compiler, or the build failed:
    the caller's torch path)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(source=source)))
    except (RuntimeError, OSError) as e:
        logger.warning("vllm-spec-plugins: C %s kernel unavailable (%s); using the slower torch path", what, e)
        return None
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def library():
    """The loaded tree-attention kernel, or None (disabled, no compiler, or the build failed: torch path)."""
    return _load(SRC, "tree_attention", _ARGTYPES, "tree-attention")


_MAMBA_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64]                                          # u, row stride
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2                    # conv, ssm buffers, strides
    + [ctypes.c_void_p] * 3 + [ctypes.c_int]                                   # slot, src, dst, b
    + [ctypes.c_void_p] * 6 + [ctypes.c_float]                                 # conv_w .. norm_w, eps
    + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2)                              # di .. K, y, scratch


@functools.lru_cache(maxsize=None)
def mamba_step():
    """The Mamba step kernel (`proposers.mamba.Mamba2Mixer.step_into` calls it), or None."""
    return _load(MAMBA_SRC, "mamba_step", _MAMBA_ARGTYPES, "Mamba step")
