#!/usr/bin/env bash
# Sets up from nothing (scripts/setup.sh) and runs the default test suite (~20 min on 2 cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
python -m vllm_spec_plugins.models build-default >/dev/null   # the embedded default model, once
if [ $# -eq 0 ]; then set -- -m "not slow"; fi   # network: one small PyPI download, skipped if offline
python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
