#!/usr/bin/env bash
# Tensor parallelism where only one GPU is lent: DTensor's overhead on a one-rank mesh at the 8B
# shape (against the plain model, the same weights), and one rank's share of TP 2 at the 8B and
# 70B shapes (its heads, MLP columns and vocabulary rows; no collectives).
set -euo pipefail
export PYTHONPATH=$PWD
python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m benchmarks.bench_tensor_parallel \
  --shape llama3_8b --tokens 300000 --compare-dp --compile --name tensor_parallel_llama3_8b_one_rank_mesh
python3 -m benchmarks.bench_tensor_parallel --shape llama3_8b --tokens 300000 --rank-share 2 --compile
python3 -m benchmarks.bench_tensor_parallel --shape llama3_70b --tokens 120000 --rank-share 2 --compile
