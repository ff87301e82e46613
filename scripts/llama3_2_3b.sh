#!/usr/bin/env bash
# llama3_2_3b on one 8-GPU node (DeepSpeed ZERO2); see recipes/model/llama3_2_3b.yaml for the batch and lr.
# Usage: scripts/llama3_2_3b.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
set -euo pipefail
exec "$(dirname "$0")/pipeline.sh" llama3_2_3b "$1" "$2" launch/accelerate/zero2_8gpu.yaml "${@:3}"
