# What ran on one H200, 2026-12-03 (issues #36 item 1, #40 item 4), commit 4a1456b.
# The GGUF parts, the prompt files and the wheels arrived as ../shared/gpu/README.md says; the
# working tree was copied to /root/repo (a later call replaces the device's checkout) and run from there.
# 1. data S regenerated (every shared chat prompt but the 100 set-aside ones, plus GSM8K, ≤ 256 new
#    tokens per turn, greedy, the store captured while answering), then three heads side by side:
#    E3, the published eagle3 head (states online: an aux store would take 42 GB of the 64 GB disk),
#    and the precision pair: the same restored head (unroll 1, 600 steps) in one process in bf16
#    mixed precision (Rb, the new default) and under DeepSpeed ZeRO-2 (Rd); loss_match.json compares
#    their curves. Only E3 is validated on the benchmarks.
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0]' TREES= \
VAL_HEADS=E3 DS_HEADS=Rd MATCH='Rd Rb' HEADS="E3 1500 model.variant=eagle3 train.unroll_steps=3 train.states=online data.train_files=[/root/push/regenerated.jsonl] data.max_seq_len=2048 precompute.compile=false
Rb 600 model.variant=rmsnorm-restored train.unroll_steps=1
Rd 600 model.variant=rmsnorm-restored train.unroll_steps=1" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &
# 2. the machine went back during E3's benchmark validation (left idle between calls); E3's head had
#    been copied out. On a fresh machine (the target converted again from the GGUF) it was validated
#    with what quality_push.sh's validate() runs, T = 0 and 1:
v() {
  python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=/root/v \
    model.variant=eagle3 validate.head=/root/e3 "validate.eval_files=[data/$1.jsonl]" \
    validate.report=/root/out/E3_$1.json validate.batch_size=80 validate.max_new_tokens=256 \
    validate.num_prompts=null "validate.chain_lengths=[1,2,3,4,5]" "validate.temperatures=[0.0,1.0]" \
    "validate.ssd_fan_outs=[1,4,8,16]"
}
v mt_bench & v vicuna_bench & wait
# 3. here (CPU): E3's native head exported in the vllm layout as heads/smollm2_135m/eagle3, after its
#    config's target record gained the vocab_hash of the tokenizer it was trained with (transformers
#    5.17's tokenizer.json of the GGUF's tokenizer, reproduced here byte for byte: ebab3b7e903b792d,
#    the same vocabulary as transformers 5.19's file):
python -c "from mtp_train.export import export_layouts; export_layouts('E3/head', 'smollm2-135m-instruct', ['vllm'], 'out')"
