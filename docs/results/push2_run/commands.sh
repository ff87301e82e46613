# What ran on one H200, 2026-12-01 (written after the run from its logs: the session's own copy of
# this file did not land). After experiments/gpu_machine.sh's set-up (/root/smol converted, prompts
# under /root/dc, wheels under /root/site).
# 1. data (the six-head experiment's: every shared chat prompt but the 100 set-aside ones, plus
#    GSM8K, ≤ 256 new tokens per turn, greedy, no aux states) and heads D, E, F side by side:
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0]' TREES= \
HEADS="D 1500 model.variant=rmsnorm-restored train.unroll_steps=3
E 1500 model.variant=rmsnorm-restored train.unroll_steps=3 model.draft_vocab_size=16384
F 1500 model.variant=rmsnorm-restored train.unroll_steps=5" bash experiments/quality_push.sh
#    F's line is inferred (a deeper unroll, 4 or 5, by its loss scale; its exact overrides were not
#    kept). F was stopped after 70 steps for device time; G (E's config, 2,400 steps) and
#    H (E's config, 2,000 steps) were started and stopped early for the same reason (logs kept).
# 2. head I alone on the same store (2,000 steps), validated at k = 1, 4, 5 with 8 teacher-forced answers:
python3 -m mtp_train.train model=smollm2_135m model.target=/root/smol run_dir=/root/push \
  train.store_dir=/root/push/store train.out_dir=/root/push/heads/I train.steps=2000 \
  train.tokens_per_micro_batch=32768 train.warmup_steps=30 train.lr=1.5e-3 train.save_every=1000 \
  logging.log_every=10 model.variant=rmsnorm-restored train.unroll_steps=3
val=(model=smollm2_135m model.target=/root/smol run_dir=/root/push validate.head=/root/push/heads/I/head
     validate.batch_size=80 validate.max_new_tokens=256 "validate.temperatures=[0.0]" validate.teacher_forced_samples=8)
python3 -m mtp_train.validate "${val[@]}" "validate.eval_files=[data/mt_bench.jsonl]" \
  validate.report=/root/push/results/I_mt_bench.json "validate.chain_lengths=[1,4,5]"
python3 -m mtp_train.validate "${val[@]}" "validate.eval_files=[data/vicuna_bench.jsonl]" \
  validate.report=/root/push/results/I_vicuna_bench.json "validate.chain_lengths=[4]"
