#!/usr/bin/env bash
# qwen3_8b on one 8-GPU node (DeepSpeed ZERO2); see recipes/model/qwen3_8b.yaml for the batch and lr.
# Usage: scripts/qwen3_8b.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
set -euo pipefail
exec "$(dirname "$0")/pipeline.sh" qwen3_8b "$1" "$2" launch/accelerate/zero2_8gpu.yaml "${@:3}"
