"""Shared fixtures: the real SmolLM2 target (converted once) and tiny random targets."""

from __future__ import annotations

import pytest
import torch

from mtp_train.demo_target import smollm2_dir
from mtp_train.target_files import write_random_target


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs several CUDA GPUs"))


@pytest.fixture(scope="session")
def smollm2():
    """Hugging Face directory of the real SmolLM2-135M-Instruct (fp32, from the GGUF)."""
    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_target(smollm2, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    return write_random_target(tmp_path_factory.mktemp("tiny_target"), smollm2, seed=0)
