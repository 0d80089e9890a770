#!/usr/bin/env python
"""Convert the packaged SmolLM2-135M-Instruct Q4_1 GGUF into a HF folder (bf16 safetensors) that
transformers and vLLM load; prints the folder. Cached: a complete folder is not rebuilt.

    python scripts/build_default_model.py            # -> $VLLM_SPEC_PLUGINS_CACHE or ~/.cache/vllm_spec_plugins/smollm2-135m-instruct
    python scripts/build_default_model.py --out DIR --force
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from vllm_spec_plugins.models import build_default_model, default_model_dir
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_spec_plugins.models import build_default_model, default_model_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"output folder (default: {default_model_dir()})")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)
    print(build_default_model(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
