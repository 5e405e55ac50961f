#!/usr/bin/env bash
# The README's test command: installs zerotrain and its test tools, then runs the suite
# (python -m pytest; multi-process tests spawn real ranks over gloo; `slow` tests are excluded,
# run them with: python3 -m pytest -m slow).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ZEROTRAIN_EXTRAS=dev,hf bash .ci/install.sh
# --durations: the slowest tests are named at the end, so a suite grown past its 15 minutes shows why
exec "${PYTHON:-python3}" -m pytest -q --durations=25 "$@"
