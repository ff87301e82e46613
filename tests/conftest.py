"""Shared fixtures: the real SmolLM2 target (converted once) and tiny random targets."""

from __future__ import annotations

import interpreter_child
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


def pytest_collection_finish(session):
    """The Triton interpreter's checks start now, in a child beside the suite (interpreter_child)."""
    if specs := interpreter_child.specs_of(session.items):
        session.config.stash[interpreter_child.CHILD] = interpreter_child.start(specs)


def pytest_unconfigure(config):
    if child := config.stash.get(interpreter_child.CHILD, None):
        interpreter_child.stop(child)


@pytest.fixture(scope="session")
def smollm2():
    """Hugging Face directory of the real SmolLM2-135M-Instruct (fp32, from the GGUF)."""
    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_target(smollm2, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    return write_random_target(tmp_path_factory.mktemp("tiny_target"), smollm2, seed=0)


@pytest.fixture(scope="session", autouse=True)
def one_vllm_child():
    """The session's vLLM engines all run in one kept child process (`vllm_engine.keep_child`):
    vLLM's import (~15 s on 2 cores) is paid once, not by each of the requests that serve (test_vllm's
    published heads in one, its Qwen3 heads one each as they are trained, its validation test's;
    outside the tests `validate.engine=vllm` starts a child per call)."""
    from mtp_train.serving import vllm_engine

    vllm_engine.keep_child(True)
    yield
    vllm_engine.keep_child(False)
