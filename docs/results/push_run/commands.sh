# What ran on one H200, 2026-12-01 (device time ran short: head C, eagle3, was stopped after 50
# steps so that A and B could finish; trees and Saguaro were validated at 128 new tokens).
# 1. data + head B (experiments/quality_push.sh with A and C skipped, then A started by hand):
N=8000 BATCH=1024 STEPS=700 bash experiments/quality_push.sh
python3 -m mtp_train.train model=smollm2_135m model.target=/root/smol run_dir=/root/push \
  train.store_dir=/root/push/store train.out_dir=/root/push/heads/A train.steps=600 \
  train.tokens_per_micro_batch=32768 train.warmup_steps=30 train.lr=1.5e-3 train.save_every=300 \
  logging.log_every=10 model.variant=rmsnorm-restored train.unroll_steps=3
# 2. the script's validations of A and B on MT-bench and vicuna-bench (256 new tokens, k = 1 … 5,
#    greedy and T = 1, SSD fan-outs 1/4/8/16): results/{A,B}_{mt,vicuna}_bench.json
# 3. trees and SSD, greedy, and sampled with Saguaro (128 new tokens):
python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=/root/push \
  validate.head=/root/push/heads/B/head "validate.eval_files=[data/mt_bench.jsonl]" \
  validate.report=/root/push/results/B_trees.json validate.batch_size=80 validate.max_new_tokens=128 \
  "validate.chain_lengths=[1,2,3,4,5]" "validate.temperatures=[0.0]" "validate.ssd_fan_outs=[1,4,8,16]" \
  "validate.tree_budgets=[4,16,32,64]" validate.tree_depth=5 validate.teacher_forced_samples=8
python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=/root/push \
  validate.head=/root/push/heads/B/head "validate.eval_files=[data/mt_bench.jsonl]" \
  validate.report=/root/push/results/B_sampled.json validate.batch_size=80 validate.max_new_tokens=128 \
  "validate.chain_lengths=[1,2,3,4,5]" "validate.temperatures=[1.0]" "validate.ssd_fan_outs=[1,4,8,16]" \
  "validate.tree_budgets=[4,16,32,64]" validate.tree_depth=5 "validate.saguaro_factors=[0.5,0.2]" \
  validate.teacher_forced_samples=8
