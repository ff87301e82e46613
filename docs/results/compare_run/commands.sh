# What ran on one H200, 2026-12-03 (issues #39 item 3, #40 item 2, #36 item 2), commit d898f26: the
# four-kind comparison's new heads and the long-input set. The GGUF parts, the prompt files and the wheels arrived as
# ../shared/gpu/README.md says; the working tree was copied to /root/repo and run from there.
# Data S regenerated (every shared chat prompt but the 100 set-aside ones and the 139 further records the
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
# 2. While the answers were being generated (the GPU 5 % busy), the 8B training benchmark: eager
#    against compiled loss chunks under DeepSpeed (its figures not kept: the regeneration's last,
#    GPU-bound stage overlapped them); repeated on the idle GPU at the end (step 5).
# 3. After 3 minutes of training the run would not fit the session's device time: the two
#    1,500-step heads (N31b at step 230, DFb at step 160) and the script were stopped; their
#    curves so far are in results/metrics_{N31b,DFb}.jsonl. The 600-step heads went on, and were
#    validated as quality_push.sh's validate() does (the SSD pass left out for time), with the
#    published eagle3 head on the long-input set:
R=/root/push
v() {  # head, head dir, report name, prompts file, overrides...
  local head=$1 dir=$2 name=$3 file=$4; shift 4
  python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=/root/v_${head}_$name \
    validate.head=$dir "validate.eval_files=[$file]" validate.report=$R/results/${head}_$name.json \
    validate.batch_size=80 validate.max_new_tokens=256 validate.num_prompts=null \
    "validate.temperatures=[0.0,1.0]" "$@" > $R/logs/validate_${head}_$name.log 2>&1
}
v E3 /root/repo/heads/smollm2_135m/eagle3 long_inputs data/long_inputs.jsonl "validate.chain_lengths=[1,2,3,4,5]" &
for b in "mt_bench data/mt_bench.jsonl" "vicuna_bench data/vicuna_bench.jsonl" "long_inputs data/long_inputs.jsonl"; do
  set -- $b
  v N31a $R/heads/N31a/head "$1" "$2" "validate.chain_lengths=[1,2,3,4,5]" &
  v DFa $R/heads/DFa/head "$1" "$2" "validate.chain_lengths=[1,2,3,4]" &
done
wait
# 4. Here (CPU): the projected speed-ups written into the MT-bench reports, and N31a published:
#    python -m mtp_train.projection results/N31a_mt_bench.json benchmarks/results/verify_cost_llama3_{8b,70b}.json
#    python -c "from mtp_train.export import export_layouts; export_layouts('N31a/head', 'smollm2-135m-instruct', ['vllm'], 'out')"
# 5. The 8B training benchmark on the idle GPU, eager and compiled loss chunks side by side:
for a in --eager-loss ""; do
  accelerate launch --config_file launch/accelerate/zero2_1gpu.yaml -m benchmarks.bench_train --shape llama3_8b --skip-loss-memory --steps 10 $a
done
for a in --eager-loss ""; do
  python3 -m benchmarks.bench_train --shape llama3_8b --precision bf16 --skip-loss-memory --steps 10 $a
done
