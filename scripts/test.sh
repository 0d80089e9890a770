#!/usr/bin/env bash
# Sets up from nothing (scripts/setup.sh) and runs the default test suite, one pytest worker per
# core (engine tests run one OpenMP thread each). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -m slow`; TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
python -m vllm_spec_plugins.tools.models build-default >/dev/null   # the embedded default model, once
# the tests' tiny model, built once here rather than raced by the workers
python -c "from vllm_spec_plugins.tools.models import build_tiny_model, cache_root; build_tiny_model(cache_root() / 'tiny-test-llama', seed=0, force=False)"
if [ $# -eq 0 ]; then set -- -m "not slow"; fi   # network: one small PyPI download, skipped if offline
workers=${TEST_WORKERS:-$(nproc)}
# --dist loadfile: a file's tests share a worker, so module fixtures (plain vLLM's reference
# outputs) run once
python -m pytest -q -p no:cacheprovider --durations=15 -n "$workers" --dist loadfile "$@" tests
