"""Whether and where the project's Triton kernels (`split_kv_attention`, `skinny_linear`) run: on
CUDA, and on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which Triton reads when a
kernel is defined: the tests set it in a child process). Without Triton they never run.

Also how they are launched one after another on Hopper and later GPUs: programmatic dependent
launch (PDL). A decode step is a chain of short memory-bound kernels (a 50 MB map reads in about
10 µs on an H200); each one's first and last microseconds read at a fraction of the bandwidth, while
its thread blocks start and while its last ones finish. Launched with PDL, a kernel's blocks start
while the kernel before finishes (that one lets them, `gdc_launch_dependents`, once its own wait is
over), prefetch their weights into L2 (read-only: no kernel writes them), and only then wait for the
kernel before (`gdc_wait`) to read what it wrote. The weights of the next map stream in during the
tail of the previous kernel, or during the attention, which reads little."""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:  # a build without Triton
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_overlap = {"pdl": True, "prefetch": True}


def runs_on(device_type: str) -> bool:
    """Whether the kernels run on tensors of this device type."""
    return triton is not None and (device_type == "cuda" or INTERPRETED)


def use_launch_overlap(pdl: bool = True, prefetch: bool = True) -> None:
    """Whether the kernels launch with PDL where the GPU has it (Hopper on), and whether the skinny
    maps prefetch their weights into L2 before they wait for the kernel before (the module
    docstring). Both on by default; off for the benchmarks' baselines (`--no-pdl`)."""
    _overlap.update(pdl=pdl, prefetch=prefetch)


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return triton is not None and torch_capability(device_index) >= (9, 0)


def torch_capability(device_index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device_index)


def launch_options(device) -> dict:
    """(PDL, PREFETCH) constexprs for a kernel on `device`, and the launch option that goes with
    PDL: none under the interpreter (it has no grid dependency control) or before Hopper."""
    pdl = device.type == "cuda" and not INTERPRETED and _overlap["pdl"] and _has_pdl(device.index or 0)
    prefetch = (
        device.type == "cuda" and not INTERPRETED and _overlap["prefetch"] and _has_pdl(device.index or 0)
    )
    return {"PDL": pdl, "PREFETCH": prefetch} | ({"launch_pdl": True} if pdl else {})


if triton is not None:

    @triton.jit
    def after_previous_kernel(PDL: tl.constexpr):
        # With PDL: wait until the kernel launched before this one has finished and its writes
        # show, then let the next kernel's blocks start (they wait in turn before they read ours).
        # Nothing before this may read what an earlier kernel writes, nor write anything.
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_rows(first, rows, row_bytes, stride_bytes, skip_from, skip, CHUNKS: tl.constexpr):
        # Ask L2 for `rows` rows of `row_bytes` bytes each, from byte address `first` (an int64),
        # `stride_bytes` apart, rows from `skip_from` on `skip` rows further: pieces of about 1 KB,
        # one bulk prefetch each (Hopper's cp.async.bulk.prefetch), at most CHUNKS (the block's
        # threads, so that no two threads ask for the same bytes; the rest ask for nothing). A hint
        # only: nothing comes into registers, and L2 keeps what other SMs write meanwhile.
        pieces = tl.maximum(1, tl.minimum(CHUNKS // rows, tl.cdiv(row_bytes, 1024)))
        c = tl.arange(0, CHUNKS)
        row, piece = c // pieces, c % pieces
        piece_bytes = tl.cdiv(tl.cdiv(row_bytes, pieces), 16) * 16
        at = first + (row + tl.where(row >= skip_from, skip, 0)).to(tl.int64) * stride_bytes
        start = (at + piece * piece_bytes) // 16 * 16  # 16-byte aligned addresses and sizes
        end = (at + tl.minimum((piece + 1) * piece_bytes, row_bytes) + 15) // 16 * 16
        size = tl.where((row < rows) & (end > start), end - start, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
