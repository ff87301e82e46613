"""`inference_ref.cpu_linear.apply_linear`: a plain fp32 map of a few rows on a CPU computed as
(W · xᵀ)ᵀ, everything else as the module computes it (speed: `benchmarks/bench_cpu_linear.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_ref import cpu_linear
from inference_ref.cpu_linear import (
    MAX_ROWS,
    VOCAB_MAX_ROWS,
    VOCAB_ROWS,
    _few_rows,
    apply_linear,
    transposes_few_rows,
)


@pytest.fixture
def transposing(monkeypatch):
    """The rule on, whatever this machine's CPU (an Intel one keeps x · Wᵀ)."""
    monkeypatch.setattr(cpu_linear, "TRANSPOSED", True)


@pytest.mark.parametrize("out_features", [96, VOCAB_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_are_transposed_products_and_the_rest_the_module(out_features, bias, transposing):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, out_features, bias=bias)
    most = VOCAB_MAX_ROWS if out_features >= VOCAB_ROWS else MAX_ROWS
    for rows in range(1, most + 3):
        x = torch.randn(1, rows, 64)  # a batch's leading dimensions are flattened into rows
        got = apply_linear(linear, x)
        transposed = (linear.weight @ x[0].T).T + (linear.bias if bias else 0)
        want = transposed[None] if 2 <= rows <= most else linear(x)
        assert got.shape == (1, rows, out_features)
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_other_modules_dtypes_and_hooked_maps_run_as_they_are(transposing):
    # the choice is asserted, not only the output: in bf16 at this shape both ways give the same bits
    linear = torch.nn.Linear(32, 48, bias=False)
    x = torch.randn(3, 32)
    assert _few_rows(linear, x)  # the control: a plain fp32 map of 3 rows takes the transposed product
    calls = []
    hook = linear.register_forward_hook(lambda module, args, out: calls.append(1))
    assert not _few_rows(linear, x)
    assert torch.equal(apply_linear(linear, x), linear(x)) and len(calls) == 2  # the hook ran both times
    hook.remove()
    half = torch.nn.Linear(32, 48, bias=False).to(torch.bfloat16)
    assert not _few_rows(half, x.bfloat16())
    assert torch.equal(apply_linear(half, x.bfloat16()), half(x.bfloat16()))

    class Scaled(torch.nn.Linear):  # another kind of map (an FP8 or tensor-parallel one)
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(32, 48, bias=False)
    assert not _few_rows(scaled, x)
    assert torch.equal(apply_linear(scaled, x), scaled(x))


def test_an_intel_cpu_keeps_the_modules_product(monkeypatch):
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
    assert not transposes_few_rows(intel)
    assert transposes_few_rows(intel.replace("GenuineIntel", "AuthenticAMD"))
    assert transposes_few_rows("")  # no /proc/cpuinfo: as on the AMD EPYC the rule was measured on
    monkeypatch.setattr(cpu_linear, "TRANSPOSED", False)
    linear = torch.nn.Linear(64, VOCAB_ROWS, bias=False)
    x = torch.randn(3, 64)
    assert not _few_rows(linear, x)
    assert torch.equal(apply_linear(linear, x), linear(x))
