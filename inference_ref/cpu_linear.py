"""A linear map of a few rows on a CPU, in fp32: x · Wᵀ computed as (W · xᵀ)ᵀ.

PyTorch's CPU build hands both to MKL's sgemm, which on this project's 2-core AMD EPYC (AVX-512,
no AMX) takes a slow path for x · Wᵀ at 2–8 rows: SmolLM2's lm_head [49152, 576] costs 24–38 ms
at 2–3 rows against 10 ms at one row, and 4–6 ms as W · xᵀ (the weights read once, as a memory-
bound map should). The small maps of a layer gain 1.1–1.9× at 2–4 rows and lose from 5 rows on,
the vocabulary's projection gains 2.3–5.7× up to 8 rows (docs/benchmarks.md, "CPU linear maps").
That is every draft step of a batch of a few prompts, and the verify steps of one, in the tests,
the demo and `validate` on a CPU. Both are MKL's fp32 dot products; their sums differ in order
only (last bits: the published heads' greedy counts are unchanged).

On a 2-core Intel Xeon with AMX the opposite holds: MKL's x · Wᵀ is the fast one and (W · xᵀ)ᵀ
costs 1.1–4.8× more at 2–6 rows, the loop 1.2–1.3× (docs/benchmarks.md). So the product is
chosen on the machine: each map's shape at each row count and thread count is timed both ways on
its first call, and (W · xᵀ)ᵀ kept only where it is at least `MARGIN` times faster (a near tie
keeps the module's own product, whichever way the timing's noise falls)."""

from __future__ import annotations

import statistics
import time

import torch

MAX_ROWS = 4
"""Rows up to which a map is computed as (W · xᵀ)ᵀ (from 2: one row is a matrix-vector product)."""
VOCAB_ROWS, VOCAB_MAX_ROWS = 16384, 8
"""A map of at least VOCAB_ROWS outputs (an lm_head) up to VOCAB_MAX_ROWS rows."""
MARGIN = 1.2
"""How much faster (W · xᵀ)ᵀ must time than x · Wᵀ to be chosen."""
TIMED_CALLS = 5
"""Calls timed each way (after one warm-up), the median kept."""
_transposed_wins: dict[tuple[int, int, int, bool, int], bool] = {}
"""The timed choice by (out, in, rows, bias, threads): whether (W · xᵀ)ᵀ was chosen."""


def apply_linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, as (W · xᵀ)ᵀ where that is faster: a plain fp32 `nn.Linear` on a CPU, for
    the few rows of `_few_rows` where this machine timed it faster, outside compiled code (whose
    graphs must not branch on a batch they keep dynamic). Any other module (FP8, tensor-parallel,
    hooked) runs as it is."""
    if not _few_rows(linear, x):
        return linear(x)
    out = _transposed(linear, x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def plain_linear(linear: torch.nn.Module) -> bool:
    """An `nn.Linear` itself (not an FP8 or tensor-parallel subclass), without hooks, whose weight
    is a plain tensor (not a DTensor shard): a map that may be computed other than by its forward."""
    return (
        type(linear) is torch.nn.Linear
        and not (linear._forward_hooks or linear._forward_pre_hooks)
        and type(linear.weight) in (torch.Tensor, torch.nn.Parameter)
    )


def _few_rows(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    if not (
        plain_linear(linear)
        and not torch.compiler.is_compiling()  # Inductor picks its own kernels, for any rows
        and x.device.type == "cpu"
        and x.dtype == linear.weight.dtype == torch.float32
    ):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    most = VOCAB_MAX_ROWS if linear.out_features >= VOCAB_ROWS else MAX_ROWS
    return 2 <= rows <= most and _transposed_faster(linear, x.reshape(rows, x.shape[-1]))


def _transposed_faster(linear: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether (W · xᵀ)ᵀ is at least `MARGIN` times faster than x · Wᵀ for this map at x's rows,
    timed on the first call of its shape (on that call's x: the cost does not depend on values)."""
    rows = x.shape[0]
    key = (linear.out_features, linear.in_features, rows, linear.bias is not None, torch.get_num_threads())
    if key not in _transposed_wins:
        with torch.no_grad():
            plain = _median_ms(lambda: linear(x))
            transposed = _median_ms(lambda: _transposed(linear, x))
        _transposed_wins[key] = transposed * MARGIN <= plain
    return _transposed_wins[key]


def _transposed(linear: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    out = (linear.weight @ rows.T).T
    return out if linear.bias is None else out + linear.bias


def _median_ms(call) -> float:
    call()
    times = []
    for _ in range(TIMED_CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
