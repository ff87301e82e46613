#!/usr/bin/env bash
# DeepSpeed ZeRO-2 kill-and-resume on one GPU with the weights-only checkpoint loader: train 2
# steps (checkpoint), resume to 4, and compare against an uninterrupted 4-step run; the exported
# head holds the optimizer's fp32 masters (not the bf16 model copy widened).
#   bash benchmarks/deepspeed_resume_check.sh TOKENIZER_DIR WORK_DIR
set -euo pipefail
tok=$1; work=$2
mkdir -p "$work"
python3 -c "from mtp_train.target_files import write_random_target; write_random_target('$work/target', '$tok', seed=0)"
common=(model=tiny_random "model.target=$work/target" "data.train_files=[tests/data/gsm8k_64.jsonl]"
        train.tokens_per_micro_batch=512 train.save_every=2 logging.log_every=1 train.warmup_steps=1)
launch=(accelerate launch --config_file launch/accelerate/zero2_1gpu.yaml -m mtp_train.train)
python3 -m mtp_train.precompute "${common[@]}" "run_dir=$work/a"
cp -r "$work/a/store" "$work/store"
"${launch[@]}" "${common[@]}" "run_dir=$work/a" train.steps=2
"${launch[@]}" "${common[@]}" "run_dir=$work/a" train.steps=4 | tee "$work/resume.log"
"${launch[@]}" "${common[@]}" "run_dir=$work/b" "precompute.store_dir=$work/store" train.steps=4
grep -q "resumed from" "$work/resume.log"
python3 - "$work" <<'PY'
import json, sys
import torch
rows = lambda run: {r["step"]: r["loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{run}/train/metrics.jsonl"))}
a, b = rows("a"), rows("b")
print("resumed:", a, "\nstraight:", b)
assert all(abs(a[s] - b[s]) <= 1e-3 * max(1, abs(b[s])) for s in (3, 4)), "resumed losses differ"
print("DEEPSPEED RESUME OK")
from safetensors.torch import load_file
head = load_file(f"{sys.argv[1]}/b/train/head/head.safetensors")
weights = [w for w in head.values() if w.is_floating_point()]
assert all(w.dtype == torch.float32 for w in weights), {w.dtype for w in weights}
widened = all(torch.equal(w, w.bfloat16().float()) for w in weights)
assert not widened, "the head holds bf16 values: the model copy, not the fp32 masters"
print("DEEPSPEED HEAD IN FP32 MASTERS OK")
PY
