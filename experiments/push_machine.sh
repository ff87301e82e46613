#!/usr/bin/env bash
# experiments/quality_push.sh on the lent GPU machine, which reaches no network: the SmolLM2 GGUF
# arrives in three parts (../shared/gpu/split_for_device.sh) under DATA_DIR with the prompt files,
# the wheels are installed under SITE. This joins and converts the target once, runs quality_push.sh
# (its knobs from the environment: HEADS, DS_HEADS, VAL_HEADS, N, GSM8K, ...), then compares the
# training curves of the heads named in MATCH (the first the baseline: experiments/loss_match.py).
#   (setsid nohup bash experiments/push_machine.sh > /root/push.log 2>&1 &)   # /root/push.finished at the end
set -euo pipefail
: "${DATA_DIR:=/root/dc}"
: "${SITE:=/root/site}"
: "${T:=/root/smol}"
: "${R:=/root/push}"
: "${MATCH:=}"
export DATA_DIR SITE T R
trap 'touch "$R.finished"' EXIT
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$DATA_DIR/smollm2.gguf" ]; then
  # however many parts it travelled in (each call takes 64 MiB with the repository's own files)
  find "$DATA_DIR" -maxdepth 1 -name 'smollm2.gguf.part*' | sort -V | xargs cat > "$DATA_DIR/smollm2.gguf"
fi
sha=$(sha256sum "$DATA_DIR/smollm2.gguf" | cut -c1-16)
[ "$sha" = b179c9523d0e6a0f ] || { echo "smollm2.gguf: sha256 $sha…, expected b179c9523d0e6a0f…"; exit 1; }
if [ ! -f "$T/config.json" ]; then
  python3 -m experiments.quality_smollm2 convert-gguf "$DATA_DIR/smollm2.gguf" "$T"
fi
bash experiments/quality_push.sh
# shellcheck disable=SC2086  # the names are words
[ -z "$MATCH" ] || python3 -m experiments.loss_match "$R" $MATCH
