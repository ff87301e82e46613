"""A linear map of a few rows (decode and verify steps) in one Triton kernel, without split-K.

At batch 1 a decode step is its weights read once. cuBLAS serves a one-row product of the
Llama-3.1-8B layer's maps at 61–85 % of an H100's bandwidth, splitting the input features of
o_proj and down_proj over thread blocks and summing the parts in a second kernel (docs/benchmarks.md,
"#36 on an H100"). Here each thread block owns `BLOCK_N` output features and reads their whole
weight rows once, for every row of x at once (`tl.dot` on a tile of 16 to `MAX_ROWS` rows; one row
is multiplied and summed along K): one kernel per map, the weights read once whatever the rows.
The block shape is timed once per (map shape, row tile), on the first call outside a CUDA graph's
capture (a few seconds per map shape, mostly Triton compiling each candidate; `_block_shape`).
A gated MLP's down_proj adds the layer's residual in its epilogue, and for one row takes
[gate | up] and computes SiLU·up in its loads (`project_gated`): two kernels fewer per layer.

A custom op, so that torch.compile calls it as it is (Inductor would otherwise fuse the map's
producers into it and recompute them per output block). Runs on CUDA, and on a CPU under
Triton's interpreter (`TRITON_INTERPRET=1`: the tests).
"""

from __future__ import annotations

import torch

from inference_ref.triton_support import INTERPRETED, runs_on, tl, triton

MAX_ROWS = 64
"""The most rows of x one call takes (the tile `tl.dot` multiplies); more go to cuBLAS."""


def _candidates(tile: int) -> list[dict]:
    """Block shapes to try for a row tile: (BLOCK_N, BLOCK_K, num_warps, num_stages). One row
    multiplies and sums along K (no tile of 16 rows to fill): narrow blocks, long K steps, and
    without pipelining stages as well as with them (a plain streaming read may do best with many
    programs resident per SM and nothing staged through shared memory: Inductor's reductions)."""
    if INTERPRETED:  # one small shape, no tuning
        shapes = [(16, 64, 4, 1)]
    elif tile == 1:
        shapes = [
            (1, 2048, 4, 1), (1, 2048, 8, 1), (1, 2048, 16, 1), (1, 4096, 8, 1), (1, 4096, 16, 1),
            (2, 4096, 8, 1),
            (2, 2048, 4, 1), (2, 2048, 8, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 1),
            (8, 1024, 8, 1), (4, 1024, 4, 3), (4, 1024, 8, 4), (8, 512, 4, 3), (8, 512, 8, 4),
            (8, 1024, 8, 4), (16, 512, 4, 3), (16, 512, 8, 4),
        ]  # fmt: skip
    else:
        shapes = [
            (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 4), (32, 256, 8, 5),
            (32, 512, 8, 3), (64, 128, 4, 5), (64, 256, 8, 4), (16, 128, 4, 3), (32, 128, 4, 4),
            (64, 64, 4, 6), (128, 64, 4, 4), (128, 128, 8, 3),
        ]  # fmt: skip
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st} for n, k, w, st in shapes]


if triton is not None:

    @triton.jit
    def _load_x(X, at, mask, K, GATED: tl.constexpr):
        # x, or with GATED silu(gate) · up of X = [gate | up] (K features each; one row), computed
        # in fp32 and rounded once to X's dtype, as the compiled MLP's fused SiLU·up kernel does.
        if GATED:
            gate = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(X + at + K, mask=mask, other=0.0).to(tl.float32)
            return (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty)
        return tl.load(X + at, mask=mask, other=0.0)

    @triton.jit
    def _skinny_gemm(
        X, W, Y, R, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        # Output features n of every row m: x[m] · w[n] (+ r[m, n] with RESIDUAL), the input
        # features in BLOCK_K steps. The weights are read once: evict_first keeps them from pushing
        # x and the next maps' inputs out of L2.
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if ROWS == 1:  # a product summed along K, accumulated in fp32
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for first in range(0, K, BLOCK_K):
                k = first + tl.arange(0, BLOCK_K)
                x = _load_x(X, k, k < K, K, GATED)
                w = tl.load(
                    W + n[:, None] * stride_wn + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0,
                    eviction_policy="evict_first",
                )
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            y = tl.sum(acc, 1)
            if RESIDUAL:
                y += tl.load(R + n, mask=n < N, other=0.0).to(tl.float32)
            tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)
        else:
            m = tl.arange(0, ROWS)
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for first in range(0, K, BLOCK_K):
                k = first + tl.arange(0, BLOCK_K)
                x = tl.load(
                    X + m[:, None] * stride_xm + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0,
                )
                w = tl.load(
                    W + n[:, None] * stride_wn + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0,
                    eviction_policy="evict_first",
                )
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            inside = (m[:, None] < M) & (n[None, :] < N)
            if RESIDUAL:
                acc += tl.load(R + m[:, None] * stride_rm + n[None, :], mask=inside, other=0.0).to(tl.float32)
            tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=inside)


_tuned: dict[tuple, dict] = {}
"""The block shape chosen per (out features, in features, row tile, gated, dtype, device)."""


def _block_shape(key: tuple, launch) -> dict:
    """The fastest candidate for `key`, timed once (`launch(shape)` runs the kernel). Never timed
    while a CUDA graph is being captured (timing synchronizes, which would break the capture): the
    first candidate serves there, unremembered, until an uncaptured call times them."""
    if key in _tuned:
        return _tuned[key]
    candidates = _candidates(key[2])
    if INTERPRETED or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = [_timed(launch, c) for c in candidates]
    if min(times) == float("inf"):
        raise RuntimeError(f"skinny_linear: no block shape runs for {key}")
    _tuned[key] = candidates[times.index(min(times))]
    return _tuned[key]


def _timed(launch, shape: dict) -> float:
    from triton.testing import do_bench

    try:
        # the median: a map of 10–15 µs is near the launch's own noise
        return do_bench(lambda: launch(shape), warmup=5, rep=20, return_mode="median")
    except Exception:  # noqa: BLE001 (a shape past this GPU's shared memory or registers: not a candidate)
        return float("inf")


@torch.library.custom_op("inference_ref::skinny_linear", mutates_args=())
def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, gated: bool = False, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (at most `MAX_ROWS` rows) @ weight [N, K]ᵀ → [..., N], as `F.linear` without bias.
    gated: x is one row [..., 2K], [gate | up], and the map takes silu(gate) · up (a gated MLP's
    down_proj at batch 1, so that the activation needs no kernel of its own). One row only: computed
    inside the tile of `tl.dot` it made the maps of 2–64 rows 2× slower on an H200.
    residual [..., N]: added to the product in fp32 before the one rounding (the layer's last
    residual add, which would otherwise be a kernel of its own)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out_features, features = weight.shape
    if flat.shape[1] != (2 if gated else 1) * features or (gated and rows != 1):
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} for weight {tuple(weight.shape)} (gated={gated})"
        )
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    r = y if residual is None else residual.reshape(rows, out_features)
    if r.stride(-1) != 1:
        r = r.contiguous()
    tile = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))  # tl.dot takes 16 rows or more
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: not used by 16-bit dots

    def launch(shape: dict) -> None:
        _skinny_gemm[(triton.cdiv(out_features, shape["BLOCK_N"]),)](
            flat, weight, y, r, rows, out_features, features,
            flat.stride(0), weight.stride(0), y.stride(0), r.stride(0),
            ROWS=tile, PRECISION=precision, GATED=gated, RESIDUAL=residual is not None, **shape,
        )  # fmt: skip

    # one block shape whether or not a residual is added: the epilogue reads N values per row
    launch(_block_shape((out_features, features, tile, gated, x.dtype, x.device), launch))
    return y.view(*x.shape[:-1], out_features)


@skinny_linear.register_fake
def _(x, weight, gated=False, residual=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def tuned_configs() -> dict[str, dict]:
    """The block shape chosen so far per (out features, in features, row tile, gated, dtype, device)."""
    return {str(key): shape for key, shape in _tuned.items()}


LINEAR_KERNELS = ("auto", "cublas", "skinny")
_linear_kernel = "auto"


def use_linear_kernel(name: str) -> None:
    """Which kernel `project` runs for a map of at most `MAX_ROWS` rows in 16 bits on CUDA:
    "cublas" (`F.linear`), "skinny" (`skinny_linear`), or "auto", the default: "skinny" inside
    compiled layers, "cublas" elsewhere (eager layers are bound by launches, not reads)."""
    global _linear_kernel
    if name not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel {name!r}: one of {', '.join(LINEAR_KERNELS)}")
    _linear_kernel = name


def project(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, through `skinny_linear` where `use_linear_kernel` says so: a plain bias-free
    `nn.Linear` (not an FP8 or tensor-parallel one, whose modules run their own kernels) on CUDA,
    16-bit, with at most `MAX_ROWS` rows."""
    if _runs_skinny(linear, x):
        return skinny_linear(x, linear.weight)
    return linear(x)


def project_gated(
    linear: torch.nn.Linear, gate_up: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`residual + linear(silu(gate) · up)` of gate_up = [gate | up] (a gated MLP's down_proj;
    no residual: the map alone). Where `project` would run `skinny_linear`, the residual is added
    in its epilogue, and for one row the activation is computed in its loads."""
    fused = _runs_skinny(linear, gate_up) and (residual is None or residual.dtype == gate_up.dtype)
    if fused and gate_up.numel() == gate_up.shape[-1]:
        return skinny_linear(gate_up, linear.weight, True, residual)
    gate, up = gate_up.chunk(2, dim=-1)
    activation = torch.nn.functional.silu(gate) * up
    if fused:
        return skinny_linear(activation, linear.weight, False, residual)
    out = linear(activation)
    return out if residual is None else residual + out


def _runs_skinny(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    kernel = _linear_kernel
    if kernel == "auto":
        kernel = "skinny" if torch.compiler.is_compiling() else "cublas"
    return kernel == "skinny" and _plain(linear) and _fits(x)


def _plain(linear: torch.nn.Module) -> bool:
    return (
        type(linear) is torch.nn.Linear
        and linear.bias is None
        and not (linear._forward_hooks or linear._forward_pre_hooks)
        and type(linear.weight) in (torch.Tensor, torch.nn.Parameter)
    )


def _fits(x: torch.Tensor) -> bool:
    return (
        runs_on(x.device.type)
        and x.dtype in (torch.bfloat16, torch.float16) + ((torch.float32,) if INTERPRETED else ())
        and x.numel() <= MAX_ROWS * x.shape[-1]
    )
