#!/usr/bin/env bash
# Installs zerotrain (editable, with the test tools) into the current Python.
# torch comes first: on a machine without CUDA the pinned CPU build (torch==2.13.0, which lies on
# disk here) is taken; any unpinned spec would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch
  else
    pip_install torch==2.13.0
  fi
fi
# extras: "dev" (test tools) by default; the test command adds "hf" (transformers, for the
# Hugging Face model tests), so every package a test imports is installed.
pip_install -e ".[${ZEROTRAIN_EXTRAS:-dev}]"
# iproute2 lets the multi-node test build two network namespaces; without it that test skips.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; }) \
    || echo "note: iproute2 could not be installed; the multi-node test will skip"
fi
"$PY" -c "import torch, zerotrain; print(f'zerotrain {zerotrain.__version__} with torch {torch.__version__}')"
# Build the compiled ops now (once per op source, into ~/.cache/zerotrain/extensions), so that no
# run or test compiles inside a timed step. The CUDA op is skipped where torch sees no GPU.
if ! "$PY" -m zerotrain.ops.report --build; then
  echo "note: the compiled ops could not be built (see above); training uses the pure-torch" \
       "fallback. Run \`python -m zerotrain.ops.report\` for details."
fi
