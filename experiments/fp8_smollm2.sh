#!/usr/bin/env bash
# The FP8 target's effect on a head (#20): the bf16 SmolLM2 answers 12k shared chat prompts; their
# states are precomputed twice, by the bf16 target and by the FP8 one (model.quantization=fp8); a
# restored head trains on each store with the same steps, tokens and lr (the six-head experiment's
# 1.5e-3, 600 × 32k tokens); each head is then validated against the bf16 target and against the
# FP8 target on MT-bench (both turns, greedy, k = 4, 256 new tokens). On the lent 2-GPU machine,
# after experiments/gpu_machine.sh's set-up (the target converted, prompts and wheels in place);
# each stage resumes. Results and write-up: docs/results/fp8_run/.
#   (setsid nohup bash experiments/fp8_smollm2.sh > /root/fp8.log 2>&1 &)   # /root/fp8.done at the end
#
# Machine paths, each from the environment (the defaults are the lent machine's):
#   DATA_DIR  /root/dc                        the prompt files
#   CHAT      $DATA_DIR/chat_prompts.jsonl    the shared chat prompts
#   SITE      /root/site                      the installed wheels, put on PYTHONPATH
#   T         /root/smol                      the target (a HF directory)
#   R         /root/fp8                       the run directory; $R.done is touched at the end
set -euo pipefail
: "${DATA_DIR:=/root/dc}"
: "${CHAT:=$DATA_DIR/chat_prompts.jsonl}"
: "${SITE:=/root/site}"
: "${T:=/root/smol}"
: "${R:=/root/fp8}"
trap 'touch "$R.done"' EXIT
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
common=(model=smollm2_135m "model.target=$T" "run_dir=$R")
on() { CUDA_VISIBLE_DEVICES=$1 python3 -m "${@:2}"; }
gpus=$(nvidia-smi -L | wc -l)  # the paired jobs below share one GPU where there is one
next() { gpu=$(( (gpu + 1) % gpus )); }

on 0 mtp_train.regenerate "${common[@]}" "regenerate.prompts=[$CHAT]" \
  regenerate.limit=12000 regenerate.max_new_tokens=256 regenerate.batch_size=512
gpu=0
for q in none fp8; do
  on $gpu mtp_train.precompute "${common[@]}" model.quantization=$q "data.train_files=[$R/regenerated.jsonl]" \
    precompute.store_dir=$R/store_$q precompute.tokens_per_batch=65536 &
  next
done
wait
for q in none fp8; do
  on $gpu mtp_train.train "${common[@]}" precompute.store_dir=$R/store_$q train.out_dir=$R/head_$q \
    train.steps=600 train.tokens_per_micro_batch=32768 train.warmup_steps=30 train.lr=1.5e-3 &
  next
done
wait
for head in none fp8; do
  (for q in none fp8; do
    on $gpu mtp_train.validate "${common[@]}" model.quantization=$q validate.head=$R/head_$head/head \
      validate.report=$R/report_head-${head}_target-$q.json "validate.eval_files=[data/mt_bench.jsonl]" \
      validate.batch_size=80 validate.max_new_tokens=256 "validate.chain_lengths=[4]" \
      "validate.temperatures=[0.0]"
  done) &
  next
done
wait
