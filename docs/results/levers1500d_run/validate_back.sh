#!/usr/bin/env bash
# Machine 2 (2026-12-05): the two heads that came back from machine 1 (trained there, validation
# cut off when the machine went back between two polling calls), validated greedy at k = 4 in bf16
# on MT-bench (both turns), the long-input set and (N31u5 only: N31sr's report came back) vicuna-bench,
# each beside the others. Carried: the GGUF in two parts (smollm2.gguf.a0, .a1) under /root/dc, the
# Hydra/GGUF wheels, the heads under .devcache/h/ (and, installed by hand in a third call after the
# first attempt failed on `import datasets`, the datasets/dill/multiprocess/fsspec wheels). Reports and logs go straight into $OUT, so that
# what finished comes back even if the call is cut at the device budget's end.
set -uo pipefail
: "${OUT:?}" "${DATA_DIR:=/root/dc}" "${T:=/root/smol}"
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cat "$DATA_DIR"/smollm2.gguf.a* > "$DATA_DIR/smollm2.gguf"
sha=$(sha256sum "$DATA_DIR/smollm2.gguf" | cut -c1-16)
[ "$sha" = b179c9523d0e6a0f ] || { echo "smollm2.gguf: sha256 $sha…, expected b179c9523d0e6a0f…"; exit 1; }
[ -f "$T/config.json" ] || python3 -m experiments.quality_smollm2 convert-gguf "$DATA_DIR/smollm2.gguf" "$T"
val() {  # head, bench
  python3 -m mtp_train.validate model=smollm2_135m "model.target=$T" run_dir=/root/v \
    "validate.head=.devcache/h/$1" "validate.eval_files=[data/$2.jsonl]" "validate.report=$OUT/${1}_$2.json" \
    validate.batch_size=80 validate.max_new_tokens=${NEW:-256} validate.num_prompts=${PROMPTS:-null} \
    "validate.temperatures=[0.0]" model.variant=eagle3.1 "validate.chain_lengths=[4]" \
    > "$OUT/validate_${1}_$2.log" 2>&1
}
for b in mt_bench long_inputs vicuna_bench; do val N31u5 $b & done
for b in mt_bench long_inputs; do val N31sr $b & done
wait
grep -h -E "^speculative decoding|^report" "$OUT"/validate_*.log
