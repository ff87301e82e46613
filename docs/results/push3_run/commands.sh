# What ran on one H200, 2026-12-02 (issue #22, third run). After experiments/gpu_machine.sh's set-up
# (/root/smol converted from the GGUF, sha256 b179c952…; prompts under /root/dc; wheels under /root/site).
# 1. data (the six-head experiment's recipe, regenerated: every shared chat prompt but the 100
#    set-aside ones, plus GSM8K, ≤ 256 new tokens per turn, greedy) and head J, 3,000 steps, lr 1.5e-3;
#    J validated on the set-aside prompts at its last step (metrics_J.jsonl, val/tau_k4):
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0]' TREES= \
HEADS="J 3000 model.variant=rmsnorm-restored train.unroll_steps=3" bash experiments/quality_push.sh
# 2. the script was stopped after training (for device time) and J validated by hand, at k = 4 on
#    both benchmarks, then at k = 1 and 5 on MT-bench, with 8 teacher-forced answers:
val=(model=smollm2_135m model.target=/root/smol run_dir=/root/push validate.head=/root/push/heads/J/head
     model.variant=rmsnorm-restored validate.batch_size=80 validate.max_new_tokens=256
     "validate.temperatures=[0.0]" validate.teacher_forced_samples=8)
for bench in mt_bench vicuna_bench; do
  python3 -m mtp_train.validate "${val[@]}" "validate.eval_files=[data/$bench.jsonl]" \
    "validate.chain_lengths=[4]" "validate.report=/root/push/results/J_$bench.json"
done
python3 -m mtp_train.validate "${val[@]}" "validate.eval_files=[data/mt_bench.jsonl]" \
  "validate.chain_lengths=[1,5]" validate.report=/root/push/results/J_mt_bench_k1_k5.json
