"""Whether and where the project's Triton kernels (`split_kv_attention`, `skinny_linear`) run: on
CUDA, and on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which Triton reads when a
kernel is defined: the tests set it in a child process). Without Triton they never run.

Also how they may follow one another on Hopper and later GPUs: programmatic dependent launch
(PDL; `use_pdl`, on by default where the GPU has it). A decode step is a chain of short
memory-bound kernels (a 50 MB map reads in about 10 µs on an H200), and each one's last thread
blocks finish while the SMs they leave idle. Launched with PDL, a kernel's blocks start once every
block of the kernel before has started and waited for its own predecessor (`gdc_launch_dependents`
after `gdc_wait`); they load what no kernel writes (a map's first block of weights) and only then
wait for the kernel before to finish (`gdc_wait`), whose writes they then see. A CUDA graph keeps
the dependency as an edge of its own."""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:  # a build without Triton
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_pdl = True  # use_pdl
_pdl_tiles = False  # use_pdl's tiles


def runs_on(device_type: str) -> bool:
    """Whether the kernels run on tensors of this device type."""
    return triton is not None and (device_type == "cuda" or INTERPRETED)


def use_pdl(on: bool = True, tiles: bool = False) -> None:
    """Whether one row's kernels launch with PDL where the GPU has it (`launch_options`, the module
    docstring); on by default. In an A/B on one H100 (2026-12-06, docs/benchmarks.md) it made the
    8B shape's decode step at batch 1 3.9 % faster (5.53 → 5.31 ms, twice) and left the other
    steps as they were (the tiles launch without it; the 70B shape's longer maps gained nothing).
    `bench_verify_cost --no-pdl` turns it off.
    tiles: with `on`, the kernels over 2 or more rows too (a verify step's 16–64-row tiles, each
    with its first block of weights loaded before the wait, as one row's); off by default: in
    the A/B on one H100 (2026-12-07, run 11, `bench_verify_cost --pdl-tiles`) the 8B verifies
    were 0-2 % slower at batch 1 and up to 6 % at batch 8. PDL alone, without the early weights,
    made them up to 3 % slower on an H100 (2026-12-06, run 1)."""
    global _pdl, _pdl_tiles
    _pdl, _pdl_tiles = on, tiles


def uses_pdl() -> tuple[bool, bool]:
    """What `use_pdl` last set, (on, tiles) (so that a check can put it back)."""
    return _pdl, _pdl_tiles


def _index(device) -> int:
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _has_pdl(device_index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_options(device, rows: int) -> dict:
    """The PDL constexpr of a kernel on `device` over `rows` rows of x (query tokens for the
    attention), and the launch option that goes with it: with `use_pdl` (the default), for one row (a
    decode step at batch 1; the tiles of 16-64 rows ran up to 3 % slower with PDL on an H100) and
    with its `tiles` for more, on Hopper and later.
    Never under the interpreter, which has no grid dependency control."""
    pdl = (
        (rows == 1 or _pdl_tiles)
        and device.type == "cuda"
        and not INTERPRETED
        and _pdl
        and _has_pdl(_index(device))
    )
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


if triton is not None:

    @triton.jit
    def after_previous_kernel(PDL: tl.constexpr):
        # With PDL: wait until the kernel launched before this one has finished and its writes
        # show, then let the next kernel's blocks start (they wait in turn before they read ours).
        # Nothing before this may read what an earlier kernel writes, nor write anything.
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
