# What ran on one H200, 2026-12-03 (issue #40 item 3): three of the levers at eagle3.1's 1,500-step
# budget, each one change from the published head N31b's recipe (docs/results/compare1500_run):
#   N31lr  lr 3e-3 (twice N31b's 1.5e-3, chosen at 600 steps in docs/results/run);
#   N31s   S″ plus one sampled answer per prompt (T = 0.8, seed 1: $R/sampled_1.jsonl, 33,951
#          conversations, 5.49M new tokens) beside the greedy ones;
#   N31m   S″ plus the long-input training mix (experiments.long_inputs mix, 500 per task: 853
#          prompts, 828 answered, 157k new tokens), none of the long-input set's records.
# Set-up (four calls: .devcache/b2 with the wheels, S″'s gz, the prompt files and the GGUF's last
# part, then one 26 MiB part each): the wheels under /root/site, the parts and prompt files under
# /root/dc, S″'s answers (regenerated.jsonl.gz, made by compare1500_run's machine-1 lines) under
# /root/push, the repository copied to /root/repo; then, in /root/repo:
on="model.variant=eagle3.1 train.unroll_steps=3 precompute.compile=false"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 AUX=false STORE=false ANSWERS=/root/push/regenerated.jsonl.gz \
SAMPLES=1 LONG_MIX=500 TEMPS='[0.0]' TREES= SSD= \
HEADS="N31lr 1500 $on train.lr=3e-3
N31s 1500 $on data.train_files=[/root/push/regenerated.jsonl,/root/push/sampled_1.jsonl]
N31m 1500 $on data.train_files=[/root/push/regenerated.jsonl,/root/push/long_mix_answers.jsonl]" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 < /dev/null &
# polled with docs/results/compare1500b_run/poll.sh; then MT-bench at T = 1 for each head:
export PYTHONPATH=/root/site:/root/repo HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
R=/root/push
for h in N31lr N31s N31m; do
  python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=$R \
    validate.head=$R/heads/$h/head "validate.eval_files=[data/mt_bench.jsonl]" \
    validate.report=$R/results/${h}_mt_bench_t1.json validate.batch_size=80 validate.max_new_tokens=256 \
    validate.num_prompts=null "validate.temperatures=[1.0]" model.variant=eagle3.1 \
    "validate.chain_lengths=[1,2,3,4,5]" > $R/logs/validate_${h}_mt_bench_t1.log 2>&1 &
done
wait
