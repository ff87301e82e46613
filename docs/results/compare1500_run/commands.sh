# What ran on one H200, 2026-12-03 (issues #39 item 3, #40): the 1,500-step eagle3.1 head that
# compare_run stopped at step 230 for device time. Two machines; see README.md.
#
# Machine 1 (commit 1d9d51a + the SSD= knob): data S″ regenerated, the long-input set fully held
# out (its 140 source records and every record opening with one of their questions: 363 records;
# compare_run's S′ held out the 140 only), every other shared chat prompt but the 100 set-aside
# ones, plus GSM8K; ≤ 256 new tokens per turn, greedy. Then N31b (eagle3.1) and DFb (dflash) side by
# side. Both finished training (N31b's set-aside τ at k = 4: 3.38); the machine was handed back
# while they were being validated, because the call that started the validation ended (a lent
# machine goes 30 s after a call), and with it the heads. Only the answers' compressed copy,
# carried out earlier, survived ($R/regenerated.jsonl.gz, 6.4 MB: 33,951 conversations, 5.24M new
# tokens in 235 s).
on=(train.states=online "data.train_files=[/root/push/regenerated.jsonl]" data.max_seq_len=2048 precompute.compile=false)
e31="model.variant=eagle3.1 train.unroll_steps=3 ${on[*]}"
df="model.variant=dflash model.block_size=5 model.aux_layers=[2,15,27] ${on[*]}"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false TEMPS='[0.0,1.0]' TREES= SSD= \
HEADS="N31b 1500 $e31
DFb 1500 $df" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &
#
# Machine 2 (commit a0ace71: online training's next target forward on a background thread): the same
# answers (S″, unpacked from the gz; not in the repository, 6.4 MB: machine 1's lines make them), N31b alone, on the budget rule of docs/results.md (32,768-token
# micro-batches, warm-up 30, cosine to 0.1 × lr, lr 1.5e-3, one decoder layer, three chained steps),
# states online, without the set-aside checks (device time): 1,500 steps in 407 s. The head came back.
R=/root/push
gzip -dc regenerated.jsonl.gz > $R/regenerated.jsonl
python3 -m mtp_train.train model=smollm2_135m model.target=/root/smol run_dir=$R train.states=online \
  "data.train_files=[$R/regenerated.jsonl]" data.max_seq_len=2048 precompute.compile=false \
  model.variant=eagle3.1 train.unroll_steps=3 train.out_dir=$R/heads/N31b train.steps=1500 \
  train.tokens_per_micro_batch=32768 train.warmup_steps=30 train.lr=1.5e-3 train.save_every=0 \
  logging.log_every=10 train.validate_every=0 "train.spec_validate_at=[]" > $R/train_N31b.log 2>&1
#
# Here (2 CPU cores, no device time left): N31b (the head came back to /work/heads_tmp/N31b) validated
# through the loop, fp32, greedy, k = 4, on MT-bench and vicuna-bench; the reports were copied to results/.
for b in mt_bench vicuna_bench; do
  python -m mtp_train.validate model=smollm2_135m model.target=/root/.cache/mtp_train/SmolLM2-135M-Instruct \
    model.variant=eagle3.1 run_dir=/tmp/v31 validate.head=/work/heads_tmp/N31b "validate.eval_files=[data/$b.jsonl]" \
    validate.report=/tmp/v31/N31b_$b.json validate.batch_size=80 validate.max_new_tokens=256 validate.num_prompts=null \
    "validate.temperatures=[0.0]" "validate.chain_lengths=[4]" validate.dtype=float32
done   # (vicuna with validate.teacher_forced_samples=0)
# Published: the vllm export, copied to heads/smollm2_135m/eagle3.1, and the CPU check's counts in card.json
python -c "from mtp_train.export import export_layouts; export_layouts('/work/heads_tmp/N31b', 'smollm2-135m-instruct', ['vllm'], '/tmp/pub/N31b')"
python -m mtp_train.projection results/N31b_mt_bench.json benchmarks/results/verify_cost_llama3_{8b,70b}.json
