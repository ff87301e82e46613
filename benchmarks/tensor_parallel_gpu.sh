#!/usr/bin/env bash
# Tensor parallelism on the lent 2-GPU machine (wheels under /root/site, tokenizer in .devtok):
# the throughput benchmarks at the 8B (TP 2 vs two data-parallel ranks) and 70B shapes (TP 2),
# then regenerate and precompute through their entry points at TP 2 against one process.
#   bash benchmarks/tensor_parallel_gpu.sh > /root/tp.log 2>&1
set -euo pipefail
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tr2=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
"${tr2[@]}" -m benchmarks.bench_tensor_parallel --shape llama3_8b --tokens 300000 --compare-dp --compile
"${tr2[@]}" -m benchmarks.bench_tensor_parallel --shape llama3_70b --tokens 120000 --compile

target=/root/tp_target
python3 -m benchmarks.tensor_parallel_entry target $target .devtok
for tp in 1 2; do
  launch=(python3); (( tp > 1 )) && launch=("${tr2[@]}")
  common=(model=tiny_random model.target=$target model.tp_size=$tp run_dir=/root/tp$tp)
  "${launch[@]}" -m mtp_train.regenerate "${common[@]}" "regenerate.prompts=[data/mt_bench.jsonl]" \
    regenerate.limit=32 regenerate.max_new_tokens=96
  # the TP 1 answers for both stores, so that they hold the same text
  "${launch[@]}" -m mtp_train.precompute "${common[@]}" "data.train_files=[/root/tp1/regenerated.jsonl]"
done
python3 -m benchmarks.tensor_parallel_entry compare /root/tp1 /root/tp2
