#!/usr/bin/env bash
# llama3_2_1b on one 8-GPU node (DeepSpeed ZERO2); see recipes/model/llama3_2_1b.yaml for the batch and lr.
# Usage: scripts/llama3_2_1b.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
set -euo pipefail
exec "$(dirname "$0")/pipeline.sh" llama3_2_1b "$1" "$2" launch/accelerate/zero2_8gpu.yaml "${@:3}"
