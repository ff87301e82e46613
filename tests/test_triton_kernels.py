"""The Triton kernels (split-key attention, the skinny linear map) on a CPU under Triton's
interpreter, against PyTorch's kernels: in a child process, since Triton reads TRITON_INTERPRET
when the kernels are defined (`tests/kernel_checks.py`; bf16 on CUDA: test_gpu.py). One child runs
every selected check in turn, so that its imports (about 5 s on 2 cores) are paid once, and starts
when the tests are collected, so that it runs beside the rest of the suite (`interpreter_child.py`);
each test reports its own check's result."""

from __future__ import annotations

import os

import interpreter_child
import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(request) -> dict[str, str]:
    """spec → "" where the check passed, else its output, for the checks of the tests selected in
    this module: the child conftest.py started when the tests were collected."""
    return interpreter_child.results(request.config.stash[interpreter_child.CHILD])


def checked(interpreted: dict[str, str], spec: str) -> None:
    assert interpreted[spec] == "", interpreted[spec]


def in_fp32_and_fp16(check: str):
    """The test's `spec`: the check in float32 and in float16 (not bf16: the interpreter's dot gets
    bf16 wrong)."""
    dtypes = ["float32", "float16"]
    return pytest.mark.parametrize("spec", [f"{check} cpu {dtype}" for dtype in dtypes], ids=dtypes)


@in_fp32_and_fp16("split_kv")
def test_split_kv_attention_matches_sdpa(interpreted, spec):
    checked(interpreted, spec)


@in_fp32_and_fp16("skinny")
def test_skinny_linear_matches_f_linear(interpreted, spec):
    checked(interpreted, spec)


@in_fp32_and_fp16("qkv_rope_cache")
def test_qkv_rope_cache_matches_the_map_rotary_and_cache_writes(interpreted, spec):
    checked(interpreted, spec)


@pytest.mark.parametrize("spec", ["draft_in_graphs cpu float32"], ids=["float32"])
def test_graphed_drafts_maps_run_the_skinny_kernels_with_in_graphs(interpreted, spec):
    checked(interpreted, spec)


@pytest.mark.parametrize("spec", ["block_shapes cpu float32"], ids=["float32"])
def test_every_block_shape_the_tuning_may_choose(interpreted, spec):
    checked(interpreted, spec)


@pytest.mark.parametrize(
    "spec", ["model_steps cpu float32", "model_steps cpu float32 compiled"], ids=["eager", "compiled"]
)
def test_target_steps_through_both_kernels_equal_sdpa_and_cublas(interpreted, spec):
    checked(interpreted, spec)


@pytest.mark.parametrize("kernel", ["skinny", "qkv_rope_cache", "split_kv"])
def test_kernels_compile_for_an_h100_or_h200(kernel):
    """Triton's own compiler and ptxas for sm90, here on the CPU (`kernel_checks.compile_for_hopper`)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels are the interpreter's here: nothing to compile")
    from kernel_checks import compile_for_hopper

    assert compile_for_hopper(kernel)


def test_pdl_is_on_by_default_for_one_rows_kernels_on_hopper_only(monkeypatch):
    """Programmatic dependent launch is on by default for kernels over one row, on a GPU that has
    it; not for tiles unless asked (`use_pdl`'s tiles), never on a CPU, the interpreter (whose
    kernels would not compile with it), or for a map whose weights are copied first;
    `use_pdl(False)` turns it off."""
    import torch

    from inference_ref import skinny_linear, triton_support

    monkeypatch.setattr(triton_support, "INTERPRETED", False)
    monkeypatch.setattr(triton_support, "_has_pdl", lambda index: index == 0)  # GPU 0 a Hopper, 1 older
    hopper, older, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    on = {"PDL": True, "launch_pdl": True}
    assert triton_support.uses_pdl() == (True, False)  # the default: one row's kernels
    try:
        assert triton_support.launch_options(hopper, 1) == on
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert triton_support.launch_options(torch.device("cuda"), 1) == on  # the current GPU
        weight = torch.zeros(8, 16)
        assert skinny_linear._launch_options(hopper, 1, weight) == on
        # a copy of the weights is a kernel that writes them just before the map reads them early
        assert skinny_linear._launch_options(hopper, 1, weight.t()) == {"PDL": False}
        for device, rows in ((hopper, 16), (hopper, 64), (older, 1), (cpu, 1)):
            assert triton_support.launch_options(device, rows) == {"PDL": False}, (device, rows)
        monkeypatch.setattr(triton_support, "INTERPRETED", True)
        assert triton_support.launch_options(hopper, 1) == {"PDL": False}
        monkeypatch.setattr(triton_support, "INTERPRETED", False)
        triton_support.use_pdl(True, tiles=True)  # the tiles too, where one row's have it
        for device, rows, pdl in ((hopper, 16, on), (hopper, 64, on), (older, 16, {"PDL": False})):
            assert triton_support.launch_options(device, rows) == pdl, (device, rows)
        assert skinny_linear._launch_options(hopper, 16, weight.t()) == {"PDL": False}
        triton_support.use_pdl(False, tiles=True)
        assert triton_support.launch_options(hopper, 1) == triton_support.launch_options(hopper, 16)
        assert triton_support.launch_options(hopper, 16) == {"PDL": False}
    finally:
        triton_support.use_pdl(True)


def test_split_kv_takes_the_head_sizes_and_tiles_it_can():
    from inference_ref.split_kv_attention import fits

    assert fits(1, 32, 8, 128) and fits(16, 32, 8, 64)
    assert not fits(1, 32, 8, 96)  # tl.arange takes powers of 2: SDPA serves this head size
    assert not fits(1, 4, 2, 8)  # tl.dot takes 16 or more
    assert not fits(17, 32, 8, 128)  # 68 query rows per K/V head: more than one tile


def test_given_block_shapes_are_used_untimed_and_a_bad_one_is_named(tmp_path):
    """`load_block_shapes` takes a benchmark's JSON (its skinny_configs, named as `tuned_configs`
    names them); the map then gets that shape without timing any, and a shape the tuning could not
    have chosen is refused with the file and the shape's name."""
    import json

    import torch

    import inference_ref.skinny_linear as skinny

    name, shape = "plain:4096,14336:16:bfloat16", skinny._candidates(16, gpu=True)[3]
    key = ("plain", 4096, 14336, 16, torch.bfloat16, torch.device("cuda", 0))
    path = tmp_path / "verify_cost.json"
    saved = dict(skinny._preset), dict(skinny._tuned)
    try:
        path.write_text(json.dumps({"skinny_configs": {name: shape}}))
        assert skinny.load_block_shapes(str(path)) == 1

        def timed(candidate):
            raise AssertionError("a given block shape was timed")

        assert skinny._block_shape(key, timed, skinny._candidates(16, gpu=True)) == shape
        assert skinny.tuned_configs()[name] == shape
        for bad, message in (
            ({name: {**shape, "BLOCK_N": 48}}, "is not a candidate for 16 rows"),
            ({name: {"BLOCK_N": 16}}, "fields"),
            ({"plain:4096:rows": shape}, "not kernel:dims:row tile:dtype"),
        ):
            path.write_text(json.dumps(bad))
            with pytest.raises(ValueError, match=f"verify_cost.json: block shape .*{message}"):
                skinny.load_block_shapes(str(path))
    finally:
        skinny._preset.clear(), skinny._tuned.clear()
        skinny._preset.update(saved[0]), skinny._tuned.update(saved[1])
