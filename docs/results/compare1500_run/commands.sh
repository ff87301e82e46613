# What ran on one H200, 2026-12-03 (issues #39 item 3, #40): the four-kind comparison's 1,500-step
# eagle3.1 and dflash heads (compare_run stopped them at steps 230 and 160 for device time). The GGUF
# parts, the prompt files and the wheels arrived as ../shared/gpu/README.md says; the working tree was
# copied to /root/repo and run from there.
# Data S″: regenerated with the long-input set fully held out (its 140 source records and every record
# opening with one of their questions: 363 records; compare_run's S′ held out the 140 only), every other
# shared chat prompt but the 100 set-aside ones, plus GSM8K; ≤ 256 new tokens per turn, greedy.
# The heads are compare_run's N31b and DFb, on the budget rule of docs/results.md (32,768-token
# micro-batches, warm-up 30, cosine to 0.1 × lr, lr 1.5e-3, one decoder layer), states online.
# Each is validated on MT-bench, vicuna-bench and the long-input set (greedy and T = 1). The answers'
# compressed copy came back with the results (for ANSWERS= on a later machine).
on=(train.states=online "data.train_files=[/root/push/regenerated.jsonl]" data.max_seq_len=2048 precompute.compile=false)
e31="model.variant=eagle3.1 train.unroll_steps=3 ${on[*]}"
df="model.variant=dflash model.block_size=5 model.aux_layers=[2,15,27] ${on[*]}"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0,1.0]' TREES= SSD= \
HEADS="N31b 1500 $e31
DFb 1500 $df" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &
