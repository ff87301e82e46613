#!/usr/bin/env bash
# The quality experiment on the lent GPU machine, which reaches no network: the SmolLM2 GGUF arrives
# in three parts (../shared/gpu/split_for_device.sh) under DATA_DIR with the prompt files
# (chat_prompts.jsonl, gsm8k_train.jsonl), the wheels are installed under SITE. This joins and
# converts the target once, then runs the experiment (resumable); $R.done marks the end.
#   (setsid nohup bash experiments/gpu_machine.sh > /root/q.log 2>&1 &)   # then poll for /root/q.done
# Arguments are passed on to `python3 -m experiments.quality_smollm2 run` (plan.FIELD=V, Hydra overrides).
#
# Machine paths, each from the environment (the defaults are the lent machine's):
#   DATA_DIR  /root/dc                        the GGUF parts (smollm2.gguf.part0, part1, …) and the prompt files
#   CHAT      $DATA_DIR/chat_prompts.jsonl    the shared chat prompts
#   GSM8K     $DATA_DIR/gsm8k_train.jsonl     the GSM8K questions
#   SITE      /root/site                      the installed wheels, put on PYTHONPATH
#   T         /root/smol                      the target, converted once from the GGUF (a HF directory)
#   R         /root/q                         the run directory; $R.done is touched at the end
set -euo pipefail
: "${DATA_DIR:=/root/dc}"
: "${CHAT:=$DATA_DIR/chat_prompts.jsonl}"
: "${GSM8K:=$DATA_DIR/gsm8k_train.jsonl}"
: "${SITE:=/root/site}"
: "${T:=/root/smol}"
: "${R:=/root/q}"
trap 'touch "$R.done"' EXIT
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$DATA_DIR/smollm2.gguf" ]; then
  # however many parts it travelled in (each call takes 64 MiB with the repository's own files)
  find "$DATA_DIR" -maxdepth 1 -name 'smollm2.gguf.part*' | sort -V | xargs cat > "$DATA_DIR/smollm2.gguf"
fi
sha256sum "$DATA_DIR/smollm2.gguf" | cut -c1-16   # b179c9523d0e6a0f…
if [ ! -f "$T/config.json" ]; then
  python3 -m experiments.quality_smollm2 convert-gguf "$DATA_DIR/smollm2.gguf" "$T"
fi
python3 -m experiments.quality_smollm2 run "$T" "$CHAT" "$GSM8K" "$R" "$@"
