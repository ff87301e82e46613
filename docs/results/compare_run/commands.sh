# What ran on one H200, 2026-12-03 (issues #39 item 3, #40 item 2): the four-kind comparison's new
# heads and the long-input set. The GGUF parts, the prompt files and the wheels arrived as
# ../shared/gpu/README.md says; the working tree was copied to /root/repo and run from there.
# Data S regenerated (every shared chat prompt but the 100 set-aside ones and the 139 records the
# long-input set is made from, plus GSM8K; ≤ 256 new tokens per turn, greedy). Four heads side by
# side, each on the budget rule of docs/results.md (32,768-token micro-batches, warm-up 30, cosine
# to 0.1 × lr, lr 1.5e-3, one decoder layer), states online (the aux states' store would not fit
# the disk): eagle3.1 with 3 chained steps at 600 and 1,500 steps; dflash with one draft layer,
# blocks of 5 (the anchor and 4 masks: k ≤ 4, the chains' headline k) fed eagle3's three target
# layers, at 600 and 1,500 steps. Each validated on MT-bench, vicuna-bench and the long-input set
# (greedy and T = 1), and so is the published eagle3 head (E3).
on=(train.states=online "data.train_files=[/root/push/regenerated.jsonl]" data.max_seq_len=2048 precompute.compile=false)
e31="model.variant=eagle3.1 train.unroll_steps=3 ${on[*]}"
df="model.variant=dflash model.block_size=5 model.aux_layers=[2,15,27] ${on[*]}"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0,1.0]' TREES= \
PUBLISHED="E3=/root/repo/heads/smollm2_135m/eagle3" HEADS="N31a 600 $e31
N31b 1500 $e31
DFa 600 $df
DFb 1500 $df" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &
