"""Load and faults through the real OpenAI server, our methods against plain vLLM.

    python scripts/load.py --requests 64 --concurrency 32 --out out/load
"""
from vllm_spec_plugins.tools.load import main

if __name__ == "__main__":
    raise SystemExit(main())
