# What ran on one H200, 2026-12-04 (issue #40 item 3): two more levers at eagle3.1's 1,500-step
# budget, from the published head N31b's recipe (docs/results/compare1500_run):
#   N31L2  a second (Llama) decoder layer stacked after EAGLE-3's first (model.draft_layers=2), on S″;
#   N31sm  both data levers of levers1500_run together: S″ + one sampled answer per prompt (T = 0.8,
#          seed 1) + the long-input training mix (500 per task), one layer.
# Nothing was carried from an earlier machine but the wheels, the two shared prompt files and the
# GGUF: S″ was regenerated here (33,951 conversations, 5.23M new tokens in 118 s; the earlier S″
# had 5.24M: bf16 greedy decoding differs on a few answers), then the mix (8 s) and the sampled
# answers (122 s). Set-up, four calls: .devcache/b2 (wheels, chat_prompts.jsonl + gsm8k_train.jsonl
# as p.tgz, the GGUF's last part), then one 26 MiB GGUF part each (g0, g1, g2):
#   pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .devcache/b2/*.whl
#   the parts and prompt files under /root/dc; the repository copied to /root/repo; then, in /root/repo:
on="model.variant=eagle3.1 train.unroll_steps=3 precompute.compile=false"
N=null GSM8K=/root/dc/gsm8k_train.jsonl NEW=256 BATCH=1024 AUX=false STORE=false SAMPLES=1 LONG_MIX=500 \
TEMPS='[0.0,1.0]' TREES= SSD= \
HEADS="N31L2 1500 $on model.draft_layers=2
N31sm 1500 $on data.train_files=[/root/push/regenerated.jsonl,/root/push/sampled_1.jsonl,/root/push/long_mix_answers.jsonl]" \
  setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 < /dev/null &
# polled with docs/results/compare1500b_run/poll.sh (each head validated as soon as it was trained:
# MT-bench, vicuna-bench and the long-input set, greedy and T = 1, k = 1 … 5, bf16).
#
# Here: N31sm published as heads/smollm2_135m/eagle3.1 (in place of N31b), its CPU check's counts in
# card.json from `python -m pytest -q -s tests/test_published_heads.py` (since 2026-12-07: `python -m pytest -q -s tests/test_vllm.py -k card`):
python -c "from mtp_train.export import export_layouts; export_layouts('<run>/heads/N31sm/head', 'smollm2-135m-instruct', ['vllm'], '/tmp/pub/N31sm')"
# projections (mtp_train.projection writes into the report: run it on a copy)
for h in N31sm N31L2; do
  python -m mtp_train.projection results/${h}_mt_bench.json benchmarks/results/verify_cost_llama3_8b.json
done
