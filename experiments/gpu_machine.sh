#!/usr/bin/env bash
# The quality experiment on the lent GPU machine, which reaches no network: the SmolLM2 GGUF arrives
# in three parts (../shared/gpu/split_for_device.sh) under /root/dc with the prompt files
# (chat_prompts.jsonl, gsm8k_train.jsonl), the wheels are installed under /root/site. This joins and
# converts the target once, then runs the experiment (resumable); /root/q.done marks the end.
#   (setsid nohup bash experiments/gpu_machine.sh > /root/q.log 2>&1 &)   # then poll for /root/q.done
set -euo pipefail
trap "touch /root/q.done" EXIT
export PYTHONPATH=/root/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f /root/dc/smollm2.gguf ]; then
  cat /root/dc/smollm2.gguf.part{0,1,2} > /root/dc/smollm2.gguf
fi
sha256sum /root/dc/smollm2.gguf | cut -c1-16   # b179c9523d0e6a0f…
if [ ! -f /root/smol/config.json ]; then
  python3 -c "from inference_ref.gguf import convert_gguf; convert_gguf('/root/dc/smollm2.gguf', '/root/smol')"
fi
python3 -m experiments.quality_smollm2 run /root/smol /root/dc/chat_prompts.jsonl /root/dc/gsm8k_train.jsonl /root/q "$@"
