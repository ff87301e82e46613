"""A linear map of a few rows on a CPU, in fp32: x · Wᵀ computed as (W · xᵀ)ᵀ.

PyTorch's CPU build hands both to MKL's sgemm, which on this project's 2-core AMD EPYC (AVX-512,
no AMX) takes a slow path for x · Wᵀ at 2–8 rows: SmolLM2's lm_head [49152, 576] costs 24–38 ms
at 2–3 rows against 10 ms at one row, and 4–6 ms as W · xᵀ (the weights read once, as a memory-
bound map should). The small maps of a layer gain 1.1–1.9× at 2–4 rows and lose from 5 rows on,
the vocabulary's projection gains 2.3–5.7× up to 8 rows (docs/benchmarks.md, "CPU linear maps").
That is every draft step of a batch of a few prompts, and the verify steps of one, in the tests,
the demo and `validate` on a CPU. Both are MKL's fp32 dot products; their sums differ in order
only (last bits: the published heads' greedy counts are unchanged).

On an Intel CPU MKL dispatches its own kernels and x · Wᵀ is the fast product: on a 2-core Intel
Xeon (AVX-512, AMX) (W · xᵀ)ᵀ cost 2–8× more at 2–3 rows and the loop 1.3× more, and 1.2× more
with MKL and PyTorch held to their AVX2 kernels (docs/benchmarks.md). So the product follows the
CPU's vendor (`TRANSPOSED`), fixed per machine rather than timed, so that two processes or two
runs on one machine compute the same bits (the ranks of a sharded target, the exact counts the
tests compare)."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_ROWS = 4
"""Rows up to which a map is computed as (W · xᵀ)ᵀ (from 2: one row is a matrix-vector product)."""
VOCAB_ROWS, VOCAB_MAX_ROWS = 16384, 8
"""A map of at least VOCAB_ROWS outputs (an lm_head) up to VOCAB_MAX_ROWS rows."""


def cpuinfo() -> str:
    """/proc/cpuinfo's text; empty where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo_values(cpuinfo: str, key: str) -> list[str]:
    """The values of `key` ("vendor_id", "model name") in /proc/cpuinfo's text: one per core."""
    pairs = (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    return [value.strip() for name, value in pairs if name.strip() == key]


def transposes_few_rows(cpuinfo: str) -> bool:
    """Whether a CPU whose /proc/cpuinfo reads `cpuinfo` computes a few rows as (W · xᵀ)ᵀ: any but
    an Intel one (measured: an AMD EPYC, where MKL's x · Wᵀ is slow at 2–8 rows, and an Intel Xeon,
    where it is the fast one). Unknown (no /proc/cpuinfo): as on the AMD EPYC."""
    return set(cpuinfo_values(cpuinfo, "vendor_id")) != {"GenuineIntel"}


TRANSPOSED = transposes_few_rows(cpuinfo())
"""Whether this machine computes a plain fp32 map of a few rows as (W · xᵀ)ᵀ (`transposes_few_rows`)."""


def apply_linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, as (W · xᵀ)ᵀ where that is faster: a plain fp32 `nn.Linear` on a CPU that
    `TRANSPOSED` names, for the few rows of `_few_rows`, outside compiled code (whose graphs must
    not branch on a batch they keep dynamic). Any other module (FP8, tensor-parallel, hooked) runs
    as it is."""
    if not _few_rows(linear, x):
        return linear(x)
    rows = x.reshape(-1, x.shape[-1])
    out = (linear.weight @ rows.T).T
    if linear.bias is not None:
        out = out + linear.bias
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
        TRANSPOSED
        and plain_linear(linear)
        and not torch.compiler.is_compiling()  # Inductor picks its own kernels, for any rows
        and x.device.type == "cpu"
        and x.dtype == linear.weight.dtype == torch.float32
    ):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    most = VOCAB_MAX_ROWS if linear.out_features >= VOCAB_ROWS else MAX_ROWS
    return 2 <= rows <= most
