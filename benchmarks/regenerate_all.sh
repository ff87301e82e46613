#!/usr/bin/env bash
# Self-distillation at scale (GPU): SmolLM2-135M-Instruct answers every shared training prompt
# (27,195 chat prompts + 7,473 GSM8K questions, each user turn in order), then precompute stores
# the hidden states of the result. Both stages print their throughput.
# Usage: benchmarks/regenerate_all.sh TARGET_DIR CHAT_PROMPTS.jsonl GSM8K.jsonl RUN_DIR [overrides...]
set -euo pipefail
target=$1; chat=$2; gsm8k=$3; run=$4; shift 4
python3 -m mtp_train.regenerate model=smollm2_135m model.target="$target" run_dir="$run" \
  "regenerate.prompts=[$chat,$gsm8k]" regenerate.max_new_tokens=256 regenerate.batch_size=512 \
  regenerate.max_prompt_tokens=1024 "$@"
python3 -m mtp_train.precompute model=smollm2_135m model.target="$target" run_dir="$run" \
  "data.train_files=[$run/regenerated.jsonl]" data.max_seq_len=2048 precompute.tokens_per_batch=65536 "$@"
