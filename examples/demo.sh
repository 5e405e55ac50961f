#!/usr/bin/env bash
# The README's demo command: installs zerotrain, then trains the demo GPT on the Python standard
# library's own source with 2 processes (DDP, fp32) and prints a generated sample.
# Extra arguments are Hydra overrides, e.g.:  bash examples/demo.sh strategy=zero2 trainer.max_steps=100
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/install.sh
exec zerotrain-train "$@"
