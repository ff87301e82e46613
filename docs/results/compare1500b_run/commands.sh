# What ran on one H200, 2026-12-03 (issues #39 item 3, #40 items 1-2): the 1,500-step heads of the
# other kinds on S″ (the answers docs/results/compare1500_run regenerated; carried as
# regenerated.jsonl.gz, 6.4 MB, not in the repository: compare1500_run's machine-1 lines make it),
# trained side by side with their states from the target inside the job, and the published
# eagle3.1 head (N31b) validated in bf16 on the GPU while they train.
# Set-up (three calls, the GGUF in three parts): the wheels under /root/site, the parts and the
# shared prompt files under /root/dc, the answers under /root/push; then, in the repository:
set -euo pipefail
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cat /root/dc/smollm2.gguf.part{0,1,2} > /root/dc/smollm2.gguf
python3 -m experiments.quality_smollm2 convert-gguf /root/dc/smollm2.gguf /root/smol > /root/convert.log 2>&1
# Online training with and without the next forward on a thread, the GPU otherwise idle
# (benchmarks/results/online_smollm2_135m_eagle3.1.json):
python3 -m benchmarks.bench_online --shape smollm2_135m --variant eagle3.1 --tokens 32768 --steps 20 \
  --unroll 3 --no-compile > /root/bench_online.log 2>&1 || true
# The heads: budget rule of docs/results.md's head J (quality_push.sh's defaults: 32,768-token
# micro-batches, warm-up 30, cosine to 0.1 × lr, lr 1.5e-3, set-aside checks every 250 steps).
on="train.states=online data.train_files=[/root/push/regenerated.jsonl] data.max_seq_len=2048 precompute.compile=false"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 AUX=false STORE=false ANSWERS=/root/push/regenerated.jsonl.gz \
TEMPS='[0.0,1.0]' TREES= SSD= PUBLISHED="N31b=$PWD/heads/smollm2_135m/eagle3.1" \
HEADS="DFb 1500 model.variant=dflash model.block_size=5 model.aux_layers=[2,15,27] $on
E3b 1500 model.variant=eagle3 train.unroll_steps=3 $on
Rb 1500 model.variant=rmsnorm-restored train.unroll_steps=3 $on" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &
