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
pip_install -e ".[dev]"
"$PY" -c "import torch, zerotrain; print(f'zerotrain {zerotrain.__version__} with torch {torch.__version__}')"
