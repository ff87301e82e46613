"""`inference_ref.cpu_linear.apply_linear`: a plain fp32 map of a few rows on a CPU computed as
(W · xᵀ)ᵀ where this machine timed that faster, everything else as the module computes it (speed:
`benchmarks/bench_cpu_linear.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_ref import cpu_linear
from inference_ref.cpu_linear import MAX_ROWS, VOCAB_MAX_ROWS, VOCAB_ROWS, _few_rows, apply_linear


@pytest.fixture
def choice(monkeypatch):
    """The timed choice made afresh in the test and forgotten after it; returns a setter of
    `MARGIN` (0: (W · xᵀ)ᵀ wherever it may be used; infinite: never)."""
    monkeypatch.setattr(cpu_linear, "_transposed_wins", {})
    return lambda margin: monkeypatch.setattr(cpu_linear, "MARGIN", margin)


@pytest.mark.parametrize("out_features", [96, VOCAB_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_are_transposed_products_and_the_rest_the_module(out_features, bias, choice):
    choice(0.0)
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


def test_other_modules_dtypes_and_hooked_maps_run_as_they_are(choice):
    # the choice is asserted, not only the output: in bf16 at this shape both ways give the same bits
    choice(0.0)
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


def test_the_product_is_the_one_timed_faster_by_the_margin_and_timed_once(choice, monkeypatch):
    """(W · xᵀ)ᵀ where it timed at least MARGIN times faster, else the module's own product; each
    map shape, row count and thread count timed once."""
    choice(1.2)
    timed, speedup = [], {"now": 1.0}

    def scripted_ms(call) -> float:  # called for x · Wᵀ, then for (W · xᵀ)ᵀ
        timed.append(call)
        return 1.0 if len(timed) % 2 else 1.0 / speedup["now"]

    monkeypatch.setattr(cpu_linear, "_median_ms", scripted_ms)
    linear = torch.nn.Linear(64, 96, bias=False)
    for rows, faster in ((2, 1.3), (3, 1.1)):
        speedup["now"] = faster
        for _ in range(2):
            assert _few_rows(linear, torch.randn(rows, 64)) == (faster >= 1.2), rows
    assert len(timed) == 4  # two row counts, each timed both ways once
    assert torch.equal(apply_linear(linear, torch.ones(3, 64)), linear(torch.ones(3, 64)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count is timed again
        speedup["now"] = 2.0
        assert _few_rows(linear, torch.randn(3, 64)) and len(timed) == 6
    finally:
        torch.set_num_threads(threads)


def test_infinite_margin_keeps_the_module_product(choice):
    choice(float("inf"))
    linear = torch.nn.Linear(64, VOCAB_ROWS, bias=False)
    for rows in range(1, VOCAB_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        assert not _few_rows(linear, x)
        assert torch.equal(apply_linear(linear, x), linear(x))
