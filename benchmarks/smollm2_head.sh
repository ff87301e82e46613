#!/usr/bin/env bash
# A trained head for the speculative wall-clock benchmark: SmolLM2-135M-Instruct's rmsnorm-restored
# head made by the quality experiment's recipe (docs/results.md: self-distilled answers, 600 steps
# of 32k tokens, lr 1.5e-3, unroll 1) on a smaller prompt set, N chat prompts taken evenly through the file and every
# GSM8K question, so that it fits in a few GPU-minutes. The head lands in WORK/train/head.
#   bash benchmarks/smollm2_head.sh TARGET_DIR chat_prompts.jsonl gsm8k_train.jsonl WORK [N=8000]
# (STEPS=2 and a small N make a quick rehearsal on CPU.)
set -euo pipefail
if [ $# -lt 4 ] || [ "${5:-8000}" -lt 1 ]; then
  echo "usage: $0 TARGET_DIR chat_prompts.jsonl gsm8k_train.jsonl WORK [N ≥ 1, default 8000]" >&2
  exit 2
fi
target=$1 chat=$2 gsm8k=$3 work=$4 n=${5:-8000}
mkdir -p "$work"
# N prompts spread over the file (it is ordered by source: its first lines are all code prompts)
stride=$(( $(wc -l < "$chat") / n )); stride=$(( stride > 0 ? stride : 1 ))
awk -v s="$stride" -v n="$n" '(NR - 1) % s == 0 && kept < n { print; kept++ }' "$chat" > "$work/chat.jsonl"
common=(model=smollm2_135m "model.target=$target" "run_dir=$work")
python -m mtp_train.regenerate "${common[@]}" "regenerate.prompts=[$work/chat.jsonl,$gsm8k]" \
  regenerate.max_new_tokens=256 regenerate.batch_size=512 regenerate.max_prompt_tokens=1024
python -m mtp_train.precompute "${common[@]}" "data.train_files=[$work/regenerated.jsonl]" \
  data.max_seq_len=2048 precompute.tokens_per_batch=65536
python -m mtp_train.train "${common[@]}" \
  model.variant=rmsnorm-restored train.lr=0.0015 "train.steps=${STEPS:-600}" train.tokens_per_micro_batch=32768 \
  train.warmup_steps=30 train.save_every=0 logging.log_every=10
