#!/usr/bin/env bash
# llama3_1_70b on one 8-GPU node (DeepSpeed ZERO3); see recipes/model/llama3_1_70b.yaml for the batch and lr.
# Usage: scripts/llama3_1_70b.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
set -euo pipefail
TP_SIZE=2 exec "$(dirname "$0")/pipeline.sh" llama3_1_70b "$1" "$2" launch/accelerate/zero3_8gpu.yaml "${@:3}"
