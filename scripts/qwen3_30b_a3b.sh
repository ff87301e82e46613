#!/usr/bin/env bash
# qwen3_30b_a3b on one 8-GPU node of H200s (DeepSpeed ZERO2; the 61 GB target does not leave room
# on an 80 GB H100, recipes/model/qwen3_30b_a3b.yaml); see the recipe for the batch and lr.
# Usage: scripts/qwen3_30b_a3b.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
set -euo pipefail
exec "$(dirname "$0")/pipeline.sh" qwen3_30b_a3b "$1" "$2" launch/accelerate/zero2_8gpu.yaml "${@:3}"
