# What ran on one H200 (issue #40 item 3; 2026-12-05, machine 1 of README.md; a first attempt on
# 2026-12-04 was cut off with its session): the two levers levers1500c_run left without a row, at eagle3.1's 1,500-step budget, against N31b's recipe (compare1500b_run, MT-bench τ 2.88):
#   N31u5  eagle3.1, unroll 5 (N31b: 3), S″;
#   N31sr  eagle3.1, unroll 3, trained on answers not cut at 256 tokens: greedy up to 1,024 new
#          tokens, each stopped where it repeats an earlier 32-token run of itself (STOP_NEW=1024
#          STOP_N=32: regenerate.stop_repeat), in place of S″.
# Regeneration now drops finished rows from the batch once half have finished
# (generate(compact=True)): levers1500c_run's stop_repeat pass kept stepping every row of a
# 512-row batch to 1,024 tokens and reached 48 % of the prompts in 11 minutes.
# Set-up, two calls: .devcache/b2 (wheels, the two shared prompt files as p.tgz, the GGUF's last
# part) with g0, then g1 with g2 (the published heads' safetensors left out of those two calls'
# working tree, to fit 64 MiB):
#   pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .devcache/b2/*.whl
#   the parts and prompt files under /root/dc; the repository copied to /root/repo; then, in /root/repo,
# two runs side by side: /root/push answers the prompts (S″) and trains N31u5 on them; /root/push_sr
# makes the stop_repeat answers meanwhile (GREEDY=false: no S″ of its own) and trains N31sr on them.
# It starts once the first has converted the target and split the prompts.
on="train.unroll_steps=3 precompute.compile=false"
common="N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 AUX=false STORE=false TEMPS=[0.0,1.0] TREES= SSD="
env $common BATCH=1024 HEADS="N31u5 1500 model.variant=eagle3.1 train.unroll_steps=5 precompute.compile=false" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 < /dev/null &
export common on
setsid nohup bash -c 'while [ ! -f /root/push/prompts/selection.jsonl ]; do sleep 5; done
  env $common R=/root/push_sr GREEDY=false BATCH=1024 STOP_NEW=1024 STOP_N=32 \
    HEADS="N31sr 1500 model.variant=eagle3.1 $on data.train_files=[/root/push_sr/stop_repeat.jsonl]" \
    bash experiments/push_machine.sh' > /root/push_sr.log 2>&1 < /dev/null &
# polled with docs/results/levers1500c_run/poll.sh (each head validated as soon as it is trained: MT-bench, vicuna-bench and the
# long-input set, greedy and T = 1, k = 1 … 5, bf16).
