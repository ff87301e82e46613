#!/usr/bin/env bash
# The full pipeline for one target size on one node:
#   scripts/pipeline.sh MODEL TARGET_DIR PROMPTS.jsonl [ACCELERATE_CONFIG] [extra Hydra overrides...]
# e.g. scripts/pipeline.sh llama3_1_8b /models/Llama-3.1-8B-Instruct data/prompts.jsonl launch/accelerate/zero2_8gpu.yaml
set -euo pipefail
model=$1; target=$2; prompts=$3; accel=${4:-launch/accelerate/zero2_8gpu.yaml}; shift $(( $# < 4 ? $# : 4 ))
common=(model="$model" model.target="$target" "$@")
run=outputs/$model
# TP_SIZE: the recipe's model.tp_size. The stages that run the whole target then run it sharded:
# regenerate and precompute as 8 / TP_SIZE groups under accelerate launch, validate as one group.
tp=${TP_SIZE:-1}
whole=(python)
(( tp > 1 )) && whole=(torchrun --standalone --nproc_per_node "$tp")

# 1. self-distillation: the target answers the prompts, each group a share (resumable)
accelerate launch --config_file "$accel" -m mtp_train.regenerate "${common[@]}" regenerate.prompts="[$prompts]"
# 2. hidden states of the regenerated conversations, each GPU writing its own shards (resumable)
accelerate launch --config_file "$accel" -m mtp_train.precompute "${common[@]}" \
  data.train_files="[$run/regenerated.jsonl]" data.holdout=256
# 3. the head (resumes from the last checkpoint under $run/train)
accelerate launch --config_file "$accel" -m mtp_train.train "${common[@]}"
# 4. acceptance on MT-bench through the serving implementations
"${whole[@]}" -m mtp_train.validate "${common[@]}" validate.eval_files="[data/mt_bench.jsonl]"
# 5. serving formats
python -m mtp_train.export "${common[@]}" export.formats="[native]"
