#!/usr/bin/env bash
# deepseek_v2_lite on one 8-GPU node (DeepSpeed ZERO2); see recipes/model/deepseek_v2_lite.yaml for the batch and lr.
# Usage: scripts/deepseek_v2_lite.sh TARGET_DIR PROMPTS.jsonl [extra Hydra overrides...]
# The vLLM layout afterwards: python -m mtp_train.export model=deepseek_v2_lite model.target=TARGET_DIR \
#   export.formats=[native,deepseek_mtp]   (docs/export.md)
set -euo pipefail
exec "$(dirname "$0")/pipeline.sh" deepseek_v2_lite "$1" "$2" launch/accelerate/zero2_8gpu.yaml "${@:3}"
