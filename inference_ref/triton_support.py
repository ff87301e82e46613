"""Whether and where the project's Triton kernels (`split_kv_attention`, `skinny_linear`) run: on
CUDA, and on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which Triton reads when a
kernel is defined: the tests set it in a child process). Without Triton they never run."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # a build without Triton
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device_type: str) -> bool:
    """Whether the kernels run on tensors of this device type."""
    return triton is not None and (device_type == "cuda" or INTERPRETED)
