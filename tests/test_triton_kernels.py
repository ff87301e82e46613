"""The Triton kernels (split-key attention, the skinny linear map) on a CPU under Triton's
interpreter, against PyTorch's kernels: each check in a child process, since Triton reads
TRITON_INTERPRET when the kernels are defined (`tests/kernel_checks.py`; bf16 on CUDA: test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def interpreted(*args: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernel_checks.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # the interpreter's dot gets bf16 wrong
def test_split_kv_attention_matches_sdpa(dtype):
    interpreted("split_kv", "cpu", dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_skinny_linear_matches_f_linear(dtype):
    interpreted("skinny", "cpu", dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_qkv_rope_cache_matches_the_map_rotary_and_cache_writes(dtype):
    interpreted("qkv_rope_cache", "cpu", dtype)


def test_every_block_shape_the_tuning_may_choose():
    interpreted("block_shapes", "cpu", "float32")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_target_steps_through_both_kernels_equal_sdpa_and_cublas(compiled):
    interpreted("model_steps", "cpu", "float32", *(["compiled"] if compiled else []))


@pytest.mark.parametrize("kernel", ["skinny", "qkv_rope_cache", "split_kv"])
def test_kernels_compile_for_an_h100_or_h200(kernel):
    """Triton's own compiler and ptxas for sm90, here on the CPU (`kernel_checks.compile_for_hopper`)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels are the interpreter's here: nothing to compile")
    from kernel_checks import compile_for_hopper

    assert compile_for_hopper(kernel)


def test_split_kv_takes_the_head_sizes_and_tiles_it_can():
    from inference_ref.split_kv_attention import fits

    assert fits(1, 32, 8, 128) and fits(16, 32, 8, 64)
    assert not fits(1, 32, 8, 96)  # tl.arange takes powers of 2: SDPA serves this head size
    assert not fits(1, 4, 2, 8)  # tl.dot takes 16 or more
    assert not fits(17, 32, 8, 128)  # 68 query rows per K/V head: more than one tile
