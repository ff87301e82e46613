# What ran on one H200, 2026-12-04 (issue #40 items 3 and 4): the last two levers at eagle3.1's
# 1,500-step budget on S″, against the published-until-now N31b's recipe (compare1500b_run), and one
# head each of the two servable kinds not yet published:
#   N31u5  eagle3.1, unroll 5 (N31b: 3), S″;
#   N31sr  eagle3.1, unroll 3, trained on answers not cut at 256 tokens: greedy up to 1,024 new
#          tokens, each stopped where it repeats an earlier 32-token run of itself (STOP_NEW=1024
#          STOP_N=32: regenerate.stop_repeat), in place of S″;
#   E1     eagle1, unroll 3, S″ (to publish: the eagle1 kind's first head past 600 steps);
#   DF1    dflash, one layer (a second would pass the 12 MB a published head may take), blocks of 5,
#          aux layers 2/15/27 as compare1500b_run's DFb, lr 3e-3 (DFb's 1.5e-3 left its set-aside CE
#          still falling: 2.47 -> 2.32 over its last 500 steps), S″ (to publish).
# Set-up, four calls, as levers1500b_run's: .devcache/b2 (wheels, the two shared prompt files as
# p.tgz, the GGUF's last part), then one 26 MiB GGUF part each (g0, g1, g2):
#   pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .devcache/b2/*.whl
#   the parts and prompt files under /root/dc; the repository copied to /root/repo; then, in /root/repo,
# two runs side by side: /root/push answers the prompts (S″) and trains three heads on them;
# /root/push_sr makes the stop_repeat answers meanwhile (GREEDY=false: no S″ of its own) and trains
# N31sr on them. It starts once the first has converted the target and split the prompts.
on="train.unroll_steps=3 precompute.compile=false"
common="N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 AUX=false STORE=false TEMPS=[0.0,1.0] TREES= SSD="
env $common BATCH=1024 HEADS="DF1 1500 model.variant=dflash model.block_size=5 model.aux_layers=[2,15,27] train.lr=3e-3 precompute.compile=false
E1 1500 model.variant=eagle1 $on
N31u5 1500 model.variant=eagle3.1 train.unroll_steps=5 precompute.compile=false" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 < /dev/null &
export common on
setsid nohup bash -c 'while [ ! -f /root/push/prompts/selection.jsonl ]; do sleep 5; done
  env $common R=/root/push_sr GREEDY=false BATCH=512 STOP_NEW=1024 STOP_N=32 \
    HEADS="N31sr 1500 model.variant=eagle3.1 $on data.train_files=[/root/push_sr/stop_repeat.jsonl]" \
    bash experiments/push_machine.sh' > /root/push_sr.log 2>&1 < /dev/null &
# polled with poll.sh (each head validated as soon as it is trained: MT-bench, vicuna-bench and the
# long-input set, greedy and T = 1, k = 1 … 5 (DF1: 1 … 4), bf16).
