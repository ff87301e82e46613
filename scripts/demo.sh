#!/usr/bin/env bash
# The whole pipeline on SmolLM2-135M-Instruct on this machine's CPU (a few minutes):
# regenerate → precompute → train → validate → export, then a summary. Extra arguments are
# Hydra overrides, e.g. `scripts/demo.sh train.steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m mtp_train.demo "$@"
