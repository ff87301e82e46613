"""A linear map of a few rows (decode and verify steps) in one Triton kernel.

At batch 1 a decode step is its weights read once. cuBLAS serves a one-row product of the
Llama-3.1-8B layer's maps at 61–85 % of an H100's bandwidth, splitting the input features of
o_proj and down_proj over thread blocks and summing the parts in a second kernel (docs/benchmarks.md,
"#36 on an H100"). Here each thread block owns `BLOCK_N` output features and reads their whole
weight rows once, for every row of x at once (`tl.dot` on a tile of 16 to `MAX_ROWS` rows; one row
is multiplied and summed along K): one kernel per map, the weights read once whatever the rows.
(Splitting K over 2–4 programs per block, their fp32 shares summed by a second kernel, was offered
to the 64-row tile and taken out: neither an H100's nor an H200's tuning ever chose it there;
docs/benchmarks.md, "Split K for the row tiles" and run 10.)
The block shape is timed once per (map shape, row tile), on the first call outside a CUDA graph's
capture (a few seconds per map shape, mostly Triton compiling each candidate; `_block_shape`).
A gated MLP's down_proj adds the layer's residual in its epilogue, and for one row takes
[gate | up] and computes SiLU·up in its loads (`project_gated`): two kernels fewer per layer; for a
tile of rows gate_up_proj computes SiLU·up in its epilogue instead (`silu_gate_up`, `project_mlp`).

A custom op, so that torch.compile calls it as it is (Inductor would otherwise fuse the map's
producers into it and recompute them per output block). Runs on CUDA, and on a CPU under
Triton's interpreter (`TRITON_INTERPRET=1`: the tests).
"""

from __future__ import annotations

import contextlib

import torch

from inference_ref.causal_lm import NormedRows, RMSNorm, residual_stream
from inference_ref.cpu_linear import apply_linear, plain_linear
from inference_ref.triton_support import INTERPRETED, launch_options, runs_on, tl, triton

if triton is not None:
    from inference_ref.triton_support import after_previous_kernel

MAX_ROWS = 64
"""The most rows of x one call takes (the tile `tl.dot` multiplies); more go to cuBLAS."""


def _candidates(tile: int, gpu: bool = not INTERPRETED) -> list[dict]:
    """Block shapes to try for a row tile: (BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP).
    One row multiplies and sums along K (no tile of 16 rows to fill): narrow blocks, long K steps,
    and without pipelining stages as well as with them (a plain streaming read may do best with many
    programs resident per SM and nothing staged through shared memory: Inductor's reductions).
    A tile of rows also tries its dot swapped (SWAP: the weight rows as the dot's M side, as
    serving engines' skinny GEMMs do, so that Hopper's wgmma, 64 rows a warp group, holds them).
    Each candidate is one more compile on the first call. Under Triton's interpreter one small
    shape, untimed (`gpu`: the GPU's, which the checks force one by one)."""
    if not gpu:
        shapes = [(16, 64, 4, 1, False)]
    elif tile == 1:
        shapes = [
            (1, 2048, 4, 1), (1, 2048, 8, 1), (1, 2048, 16, 1), (1, 4096, 8, 1), (1, 4096, 16, 1),
            (2, 4096, 8, 1),
            (2, 2048, 4, 1), (2, 2048, 8, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 1),
            (8, 1024, 8, 1), (4, 1024, 4, 3), (4, 1024, 8, 4), (8, 512, 4, 3), (8, 512, 8, 4),
            (8, 1024, 8, 4), (16, 512, 4, 3), (16, 512, 8, 4),
            (8, 1024, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 1), (16, 2048, 16, 1),
        ]  # fmt: skip
        shapes = [(*shape, False) for shape in shapes]
    else:
        shapes = [
            (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 4), (32, 256, 8, 5),
            (32, 512, 8, 3), (64, 128, 4, 5), (64, 256, 8, 4), (16, 128, 4, 3), (32, 128, 4, 4),
            (64, 64, 4, 6), (128, 64, 4, 4), (128, 128, 8, 3), (16, 256, 8, 5), (32, 128, 8, 4),
            (64, 64, 8, 8),
        ]  # fmt: skip
        swapped = [(64, 128, 4, 4), (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3)]
        shapes = [(*shape, False) for shape in shapes] + [(*shape, True) for shape in swapped]
    return [
        {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st, "SWAP": swap}
        for n, k, w, st, swap in shapes
    ]


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
    def _weight_block(W, n, k, N, K, stride_wn):
        # w[n, k] (zeros past N and K). The weights are read once: evict_first keeps them from
        # pushing x and the next maps' inputs out of L2.
        return tl.load(
            W + n[:, None] * stride_wn + k[None, :],
            mask=(n[:, None] < N) & (k[None, :] < K),
            other=0.0,
            eviction_policy="evict_first",
        )

    @triton.jit
    def _first_weights(W, n, N, K, stride_wn, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # With PDL one row's first block of weights w[n, :BLOCK_K], loaded before the wait for the
        # kernel before (`triton_support`: no kernel writes them), so that they stream in while its
        # last blocks finish; without, nothing (each K step loads its own).
        if PDL:
            w = _weight_block(W, n, tl.arange(0, BLOCK_K), N, K, stride_wn)
        else:
            w = 0.0  # unused (an expression returning None does not compile in Triton 3.6)
        return w

    @triton.jit
    def _row_step(
        acc, squares, X, W, G, n, N, first, K, stride_wn, w_first,
        BLOCK_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, PRELOADED: tl.constexpr,
    ):  # fmt: skip
        # One K step of `_row_product`: x (normed), then the weights (`w_first` where PRELOADED).
        k = first + tl.arange(0, BLOCK_K)
        x = _load_x(X, k, k < K, K, GATED).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(G + k, mask=k < K, other=0.0).to(tl.float32)
        if PRELOADED:
            w = w_first
        else:
            w = _weight_block(W, n, k, N, K, stride_wn)
        return acc + w.to(tl.float32) * x[None, :], squares

    @triton.jit
    def _row_product(
        X, W, G, n, N, K, stride_wn, eps, w_first,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # x · w[n] of one row x, [BLOCK_N] in fp32: multiplied and summed along K, in BLOCK_K steps
        # (with PDL the first one's weights are `w_first`). NORM: of rms_norm(x) · G instead, the
        # sum of squares gathered from the same loads and 1/rms applied to the sums.
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        start = 0
        if PDL:
            acc, squares = _row_step(
                acc, squares, X, W, G, n, N, 0, K, stride_wn, w_first, BLOCK_K, GATED, NORM, True
            )
            start = BLOCK_K
        for first in range(start, K, BLOCK_K):
            acc, squares = _row_step(
                acc, squares, X, W, G, n, N, first, K, stride_wn, w_first, BLOCK_K, GATED, NORM, False
            )
        y = tl.sum(acc, 1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(squares, 0) / K + eps)
        return y

    @triton.jit
    def _tile_step(
        acc, X, W, n, m, first, M, N, K, stride_xm, stride_wn, w_first,
        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr, PRELOADED: tl.constexpr,
    ):  # fmt: skip
        # One K step of `_tile_product` (the weights `w_first` where PRELOADED).
        k = first + tl.arange(0, BLOCK_K)
        x = tl.load(
            X + m[:, None] * stride_xm + k[None, :],
            mask=(m[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        if PRELOADED:
            w = w_first
        else:
            w = _weight_block(W, n, k, N, K, stride_wn)
        if SWAP:
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        return acc

    @triton.jit
    def _tile_product(
        X, W, n, M, N, K, stride_xm, stride_wn, w_first, SQ, eps,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        SWAP: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
    ):  # fmt: skip
        # x[m] · w[n] for the tile's rows m, [ROWS, BLOCK_N] in fp32 (`tl.dot`; with PDL the first
        # K step's weights are `w_first`). x goes into the dot as loaded: computed on before it
        # (SiLU·up, 2026-12-05) the maps ran 2× slower on an H200. SWAP: w · xᵀ, [BLOCK_N, ROWS],
        # transposed once at the end. SCALED: x = h · g of a norm the map producing h began, and
        # each row's sums scaled by its 1 / rms (`_inverse_rms`, read before the K loop so that
        # its loads overlap the weights' stream rather than follow it).
        m = tl.arange(0, ROWS)
        if SCALED:
            scales = _inverse_rms(SQ, M, K, eps, ROWS)
        if SWAP:
            acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        start = 0
        if PDL:
            acc = _tile_step(
                acc, X, W, n, m, 0, M, N, K, stride_xm, stride_wn, w_first, BLOCK_K, PRECISION, SWAP, True
            )  # fmt: skip
            start = BLOCK_K
        for first in range(start, K, BLOCK_K):
            acc = _tile_step(
                acc, X, W, n, m, first, M, N, K, stride_xm, stride_wn, w_first,
                BLOCK_K, PRECISION, SWAP, False,
            )  # fmt: skip
        if SWAP:
            acc = tl.trans(acc)
        if SCALED:
            acc = acc * scales[:, None]
        return acc

    @triton.jit
    def _inverse_rms(SQ, M, K, eps, ROWS: tl.constexpr):
        # 1 / rms of each row of x from SQ [K / 16, M], the sums of squares of each 16 of its
        # features that the map producing x wrote (`_norm_out`): [ROWS], zeros past M.
        m = tl.arange(0, ROWS)
        total = tl.zeros([ROWS], tl.float32)
        for first in range(0, K // 16, 64):
            p = first + tl.arange(0, 64)
            part = tl.load(
                SQ + p[:, None] * M + m[None, :], mask=(p[:, None] < K // 16) & (m[None, :] < M), other=0.0
            )
            total += tl.sum(part, 0)
        return tl.rsqrt(total / K + eps)

    @triton.jit
    def _norm_out(y, G, YG, SQ, n, m, M, N, stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        # For the RMSNorm after a map (`NormedRows`), from its rounded output y [ROWS, BLOCK_N]:
        # y · g into YG, and y's sums of squares over each 16 of its features into SQ [N / 16, M],
        # which the next map adds up for 1 / rms (`_inverse_rms`).
        GROUPS: tl.constexpr = BLOCK_N // 16
        y = y.to(tl.float32)
        g = tl.load(G + n, mask=n < N, other=0.0).to(tl.float32)
        inside = (m[:, None] < M) & (n[None, :] < N)
        tl.store(
            YG + m[:, None] * stride_ym + n[None, :], (y * g[None, :]).to(YG.dtype.element_ty), mask=inside
        )
        squares = tl.sum(tl.reshape(y * y, [ROWS, GROUPS, 16]), 2)
        group = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
        there = (m[:, None] < M) & (group[None, :] < N // 16)
        tl.store(SQ + group[None, :] * M + m[:, None], squares, mask=there)

    @triton.jit
    def _skinny_gemm(
        X, W, Y, R, G, YG, SQ, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        GATED: tl.constexpr, RESIDUAL: tl.constexpr, NORM: tl.constexpr, SWAP: tl.constexpr,
        PDL: tl.constexpr, SCALED: tl.constexpr, NORM_OUT: tl.constexpr,
    ):  # fmt: skip
        # Output features n of every row m: x[m] · w[n] (+ r[m, n] with RESIDUAL). A tile of rows
        # may take x = h · g of a norm's input h, its sums of squares in SQ (SCALED: the product
        # scaled by each row's 1 / rms), or give the next map those of its own output (NORM_OUT:
        # y · g into YG, g = G, and the squares into SQ).
        tl.static_assert(ROWS > 1 or not (SCALED or NORM_OUT), "a norm across kernels: tiles only")
        tl.static_assert(not (SCALED and NORM_OUT), "SQ is the squares in or out")
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_first = _first_weights(W, n, N, K, stride_wn, BLOCK_K, PDL)
        after_previous_kernel(PDL)
        if ROWS == 1:
            y = _row_product(X, W, G, n, N, K, stride_wn, eps, w_first, BLOCK_N, BLOCK_K, GATED, NORM, PDL)
            if RESIDUAL:
                y += tl.load(R + n, mask=n < N, other=0.0).to(tl.float32)
            tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)
        else:
            m = tl.arange(0, ROWS)
            acc = _tile_product(
                X, W, n, M, N, K, stride_xm, stride_wn, w_first, SQ, eps,
                ROWS, BLOCK_N, BLOCK_K, PRECISION, SWAP, PDL, SCALED,
            )  # fmt: skip
            inside = (m[:, None] < M) & (n[None, :] < N)
            if RESIDUAL:
                r = tl.load(R + m[:, None] * stride_rm + n[None, :], mask=inside, other=0.0)
                acc += r.to(tl.float32)
            y = acc.to(Y.dtype.element_ty)
            tl.store(Y + m[:, None] * stride_ym + n[None, :], y, mask=inside)
            if NORM_OUT:
                _norm_out(y, G, YG, SQ, n, m, M, N, stride_ym, ROWS, BLOCK_N)

    @triton.jit
    def _silu_gate_up(
        X, W, Y, SQ, M, N, K, stride_xm, stride_wn, stride_ym, eps,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        SWAP: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
    ):  # fmt: skip
        # silu(gate) · up of BLOCK_N / 2 features j for every row m, of W = [gate | up] (N / 2 rows
        # each): the weight rows of gate j and up j side by side in the block, as `_qkv_rope_cache`
        # holds rotary pairs, so that the epilogue has both. Each is rounded to Y's dtype first, as
        # the map's output would be, then the activation computed in fp32 and rounded once, as the
        # compiled MLP's fused SiLU·up kernel does. SCALED: x = h · g, as `_skinny_gemm`'s.
        PAIRS: tl.constexpr = BLOCK_N // 2
        j = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
        n = tl.reshape(tl.join(j, j + N // 2), [BLOCK_N])
        m = tl.arange(0, ROWS)[:, None]
        w_first = _first_weights(W, n, N, K, stride_wn, BLOCK_K, PDL)
        after_previous_kernel(PDL)
        y = _tile_product(
            X, W, n, M, N, K, stride_xm, stride_wn, w_first, SQ, eps,
            ROWS, BLOCK_N, BLOCK_K, PRECISION, SWAP, PDL, SCALED,
        )  # fmt: skip
        gate, up = tl.split(tl.reshape(y, [ROWS, PAIRS, 2]))
        gate = gate.to(Y.dtype.element_ty).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        tl.store(Y + m * stride_ym + j[None, :], y.to(Y.dtype.element_ty), mask=m < M)

    @triton.jit
    def _qkv_rope_cache(
        X, W, G, Q, KC, VC, Cos, Sin, Slots, SQ, M, K, new, eps,
        stride_xm, stride_wn, stride_qm, stride_qh, stride_cm, stride_sb, stride_ss,
        stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        NORM: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
    ):  # fmt: skip
        # BLOCK_N / 2 rotary pairs (j, j + DIM / 2) of one head of q, k or v: the weight rows of
        # each pair side by side, so that the epilogue rotates q and k as `apply_rotary` does (the
        # rotate_half convention), then stores q, or writes k or v into its cache at the rows' slots.
        # SCALED: x = h · g, as `_skinny_gemm`'s.
        PAIRS: tl.constexpr = BLOCK_N // 2
        HALF: tl.constexpr = DIM // 2
        pair = tl.program_id(0) * PAIRS
        head = pair // HALF
        j = pair % HALF + tl.arange(0, PAIRS)
        lower = head * DIM + j
        n = tl.reshape(tl.join(lower, lower + HALF), [BLOCK_N])
        N = (HEADS + 2 * KV_HEADS) * DIM
        w_first = _first_weights(W, n, N, K, stride_wn, BLOCK_K, PDL)
        after_previous_kernel(PDL)
        if ROWS == 1:
            m = tl.arange(0, 1)[:, None]
            y = _row_product(X, W, G, n, N, K, stride_wn, eps, w_first, BLOCK_N, BLOCK_K, False, NORM, PDL)
            a, b = tl.split(tl.reshape(y, [1, PAIRS, 2]))
        else:
            m = tl.arange(0, ROWS)[:, None]
            y = _tile_product(
                X, W, n, M, N, K, stride_xm, stride_wn, w_first, SQ, eps,
                ROWS, BLOCK_N, BLOCK_K, PRECISION, SWAP, PDL, SCALED,
            )  # fmt: skip
            a, b = tl.split(tl.reshape(y, [ROWS, PAIRS, 2]))
        there = m < M
        j = j[None, :]
        if head < HEADS + KV_HEADS:  # q or k: rotated (cos and sin repeat over the two halves)
            cos = tl.load(Cos + m * stride_cm + j, mask=there, other=0.0).to(tl.float32)
            sin = tl.load(Sin + m * stride_cm + j, mask=there, other=0.0).to(tl.float32)
            a, b = a * cos - b * sin, b * cos + a * sin
        if head < HEADS:
            at = Q + m * stride_qm + head * stride_qh + j
            tl.store(at, a.to(Q.dtype.element_ty), mask=there)
            tl.store(at + HALF, b.to(Q.dtype.element_ty), mask=there)
        else:
            row, step = (m // new).to(tl.int64), m % new  # row · stride: past 2³¹ at B·L > 2M
            slot = tl.load(Slots + row * stride_sb + step * stride_ss, mask=there, other=0)
            if head < HEADS + KV_HEADS:
                at = KC + row * stride_kb + slot * stride_kl + (head - HEADS) * stride_kh + j
            else:
                at = VC + row * stride_vb + slot * stride_vl + (head - HEADS - KV_HEADS) * stride_vh + j
            tl.store(at, a.to(KC.dtype.element_ty), mask=there)
            tl.store(at + HALF, b.to(KC.dtype.element_ty), mask=there)


_tuned: dict[tuple, dict] = {}
"""The block shape chosen per (kernel, the map's shape, row tile, dtype, device)."""
_preset: dict[str, dict] = {}
"""Block shapes given instead of timed, by `_name` (`preset_block_shapes`)."""


def _block_shape(key: tuple, launch, candidates: list[dict]) -> dict:
    """The block shape for `key`: a preset one (`preset_block_shapes`), else the fastest of
    `candidates`, timed once (`launch(shape)` runs the kernel). Never timed while a CUDA graph is
    being captured (timing synchronizes, which would break the capture): the first candidate
    serves there, unremembered, until an uncaptured call times them."""
    if key in _tuned:
        return _tuned[key]
    preset = _preset.get(_name(key))
    if preset is not None:
        if not INTERPRETED and preset not in candidates:  # e.g. blocks of rotary pairs too wide
            raise ValueError(f"block shape {_name(key)!r}: {preset} is not a candidate of this map")
        _tuned[key] = preset
        return preset
    if INTERPRETED or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = [_timed(launch, c) for c in candidates]
    if min(times) == float("inf"):
        raise RuntimeError(f"skinny_linear: no block shape runs for {key}")
    _tuned[key] = candidates[times.index(min(times))]
    return _tuned[key]


def _timed(launch, shape: dict) -> float:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError
    from triton.testing import do_bench

    try:
        # the median: a map of 10–15 µs is near the launch's own noise
        return do_bench(lambda: launch(shape), warmup=5, rep=20, return_mode="median")
    except (OutOfResources, PTXASError, CompilationError):  # past this GPU's shared memory or registers
        return float("inf")  # not a candidate; any other error (a fault) is raised as it is


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as [rows, features] with unit stride along features, and its row tile (1, or 16 to
    `MAX_ROWS`: `tl.dot` takes 16 rows or more)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    return flat, 1 if rows == 1 else max(16, triton.next_power_of_2(rows))


def _launch_options(device: torch.device, tile: int, weight: torch.Tensor) -> dict:
    """`launch_options` for a map of these weights, without PDL where they need a copy first: the
    copy is a kernel that writes them, and with PDL the map reads its first weights before it waits
    for the kernel before."""
    return launch_options(device, tile) if weight.stride(-1) == 1 else {"PDL": False}


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: not used by 16-bit dots


@torch.library.custom_op("inference_ref::skinny_linear", mutates_args=())
def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (at most `MAX_ROWS` rows) @ weight [N, K]ᵀ → [..., N], as `F.linear` without bias.
    gated: x is one row [..., 2K], [gate | up], and the map takes silu(gate) · up (a gated MLP's
    down_proj at batch 1, so that the activation needs no kernel of its own). One row only: computed
    inside the tile of `tl.dot` it made the maps of 2–64 rows 2× slower on an H200.
    residual [..., N]: added to the product in fp32 before the one rounding (the layer's last
    residual add, which would otherwise be a kernel of its own).
    norm_weight [K]: the map takes `rms_norm(x, norm_weight, eps)` of one row (the RMSNorm before
    it, whose sum of squares comes from the loads the product makes anyway; one kernel fewer. One
    row only, as gated).
    squares [K / 16, rows]: x is h · g of a tile of rows whose RMSNorm (weight g) the map producing
    h left to this one (`skinny_linear_norm_out`): the product is scaled by each row's 1 / rms,
    from these sums of squares of h and eps (one kernel fewer for a tile)."""
    return _skinny(x, weight, gated, residual, norm_weight, eps, squares)[0]


@skinny_linear.register_fake
def _(x, weight, gated=False, residual=None, norm_weight=None, eps=0.0, squares=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("inference_ref::skinny_linear_norm_out", mutates_args=())
def skinny_linear_norm_out(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = residual + x @ weightᵀ (residual None: left out) for a tile of 2 to `MAX_ROWS` rows, and
    what the RMSNorm after it (weight g = norm_weight [N]) needs, from the same epilogue: (h, h · g,
    the sums of squares of each 16 of h's features [N / 16, rows]). The next map takes the last two
    (`skinny_linear`'s or `silu_gate_up`'s squares) instead of a norm kernel running between them.
    N must be a multiple of 16."""
    if x.numel() == x.shape[-1] or norm_weight.shape != weight.shape[:1] or weight.shape[0] % 16:
        raise ValueError(
            f"skinny_linear_norm_out: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"norm_weight {tuple(norm_weight.shape)}"
        )
    y, scaled, squares = _skinny(x, weight, False, residual, norm_weight, 0.0, None, norm_out=True)
    return y, scaled, squares


@skinny_linear_norm_out.register_fake
def _(x, weight, residual, norm_weight):
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    return (
        y,
        torch.empty_like(y),
        x.new_empty(weight.shape[0] // 16, x.numel() // x.shape[-1], dtype=torch.float32),
    )


def _skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    squares: torch.Tensor | None,
    norm_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_skinny_gemm` for `skinny_linear` and `skinny_linear_norm_out` (norm_out: norm_weight is
    the norm's after the map, not before): (y, y · g, squares), the last two y where not norm_out."""
    flat, tile = _rows(x)
    rows = flat.shape[0]
    out_features, features = weight.shape
    one_row_only = gated or (norm_weight is not None and not norm_out)
    if (
        flat.shape[1] != (2 if gated else 1) * features
        or (one_row_only and rows != 1)
        or (gated and norm_weight is not None)
        or not _fits_squares(squares, features, rows)
    ):
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} for weight {tuple(weight.shape)} (gated={gated}"
            + ("" if squares is None else f", squares {tuple(squares.shape)}")
            + ")"
        )
    pdl = _launch_options(x.device, tile, weight)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    r = y if residual is None else residual.reshape(rows, out_features)
    if r.stride(-1) != 1:
        r = r.contiguous()
    g = y if norm_weight is None else norm_weight.contiguous()
    scaled = torch.empty_like(y) if norm_out else y
    if norm_out:
        sq = torch.empty(out_features // 16, rows, device=x.device, dtype=torch.float32)
    else:
        sq = y if squares is None else squares.contiguous()

    def launch(shape: dict) -> None:
        _skinny_gemm[(triton.cdiv(out_features, shape["BLOCK_N"]),)](
            flat, weight, y, r, g, scaled, sq, rows, out_features, features,
            flat.stride(0), weight.stride(0), y.stride(0), r.stride(0), eps,
            ROWS=tile, PRECISION=_precision(x), GATED=gated, RESIDUAL=residual is not None,
            NORM=norm_weight is not None and not norm_out, SCALED=squares is not None, NORM_OUT=norm_out,
            **shape, **pdl,
        )  # fmt: skip

    # one block shape with or without a residual or a norm: they add N or K values a row
    key = ("gated" if gated else "plain", out_features, features, tile, x.dtype, x.device)
    launch(_block_shape(key, launch, _candidates(tile)))
    lead = x.shape[:-1]
    return y.view(*lead, out_features), scaled.view(*lead, out_features), sq


@torch.library.custom_op("inference_ref::silu_gate_up", mutates_args=())
def silu_gate_up(
    x: torch.Tensor, weight: torch.Tensor, squares: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """silu(gate) · up of [gate | up] = x @ weightᵀ (weight [2I, K], the gate's rows first) →
    [..., I]: a gated MLP's gate_up_proj and its activation in one kernel, for 2 to `MAX_ROWS` rows
    (one row takes the activation into down_proj's loads instead: `skinny_linear`'s gated). The
    activation is computed in the epilogue on the tile's sums (`_silu_gate_up`): x goes into the
    dot as loaded, which the tiles need (module docstring). One kernel a layer fewer in a verify
    step, and half of gate_up's output written. I must be a multiple of 8 (`fits_silu_gate_up`).
    squares, eps: x is h · g, the norm before the map left to it (`skinny_linear`'s)."""
    flat, tile = _rows(x)
    rows = flat.shape[0]
    out_features, features = weight.shape
    if (
        rows == 1
        or flat.shape[1] != features
        or not fits_silu_gate_up(out_features)
        or not _fits_squares(squares, features, rows)
    ):
        raise ValueError(f"silu_gate_up: x {tuple(x.shape)} for weight {tuple(weight.shape)}")
    pdl = _launch_options(x.device, tile, weight)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(rows, out_features // 2, device=x.device, dtype=x.dtype)
    sq = y if squares is None else squares.contiguous()

    def launch(shape: dict) -> None:
        _silu_gate_up[(out_features // shape["BLOCK_N"],)](
            flat, weight, y, sq, rows, out_features, features,
            flat.stride(0), weight.stride(0), y.stride(0), eps,
            ROWS=tile, PRECISION=_precision(x), SCALED=squares is not None, **shape, **pdl,
        )  # fmt: skip

    key = ("silu_gate_up", out_features, features, tile, x.dtype, x.device)
    launch(_block_shape(key, launch, [c for c in _candidates(tile) if out_features % c["BLOCK_N"] == 0]))
    return y.view(*x.shape[:-1], out_features // 2)


@silu_gate_up.register_fake
def _(x, weight, squares=None, eps=0.0):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


def fits_silu_gate_up(out_features: int) -> bool:
    """Whether `silu_gate_up` takes a [gate | up] map of `out_features`: whole blocks of pairs for
    the narrowest candidate of every tile (BLOCK_N 16; the tuning tries those dividing 2I)."""
    return out_features % 16 == 0


@torch.library.custom_op("inference_ref::qkv_rope_cache", mutates_args=("k_cache", "v_cache"))
def qkv_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Llama attention's fused q|k|v map with what follows it up to the attention, in one kernel:
    x [B, S, K] (at most `MAX_ROWS` tokens; `rms_norm(x, norm_weight, eps)` where norm_weight is
    given, one token only, as `skinny_linear`'s) @ weight [(H + 2·Hkv)·d, K]ᵀ, q and k rotated by cos/sin [B, S, d] (`apply_rotary`),
    k and v written into the caches [B, L, Hkv, d] at slots [B, S] → q [B, S, H, d]. Three
    elementwise kernels fewer per layer than the map and Inductor's rotary and cache writes. The
    slots are the caller's to keep inside the cache (checking them would synchronize the step).
    squares [K / 16, B·S]: x is h · g of a tile of rows whose RMSNorm the map producing h left to
    this one, as `skinny_linear`'s (the layer before's down_proj: `NormedRows`)."""
    batch, new = slots.shape
    kv_heads, dim = k_cache.shape[2:]
    heads, features = weight.shape[0] // dim - 2 * kv_heads, x.shape[-1]
    if (
        not fits_qkv_rope_cache(weight.shape[0], dim, kv_heads)
        or x.shape != (batch, new, features)
        or weight.shape[1] != features
        or (norm_weight is not None and batch * new != 1)
        or not _fits_squares(squares, features, batch * new)
        or v_cache.shape != k_cache.shape
        or k_cache.dtype != v_cache.dtype
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
        or cos.shape != (batch, new, dim)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"qkv_rope_cache: x {tuple(x.shape)}, weight {tuple(weight.shape)}, caches "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, cos {tuple(cos.shape)}, slots {tuple(slots.shape)}"
        )
    flat, tile = _rows(x)
    q = x.new_empty(batch, new, heads, dim)
    cos, sin = (t.reshape(-1, dim) for t in (cos, sin))
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    pdl = _launch_options(x.device, tile, weight)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    g = q if norm_weight is None else norm_weight.contiguous()
    sq = q if squares is None else squares.contiguous()

    def launch(shape: dict) -> None:
        _qkv_rope_cache[(weight.shape[0] // shape["BLOCK_N"],)](
            flat, weight, g, q, k_cache, v_cache, cos, sin, slots, sq, flat.shape[0], flat.shape[1], new, eps,
            flat.stride(0), weight.stride(0), q.stride(1), q.stride(2), cos.stride(0),
            slots.stride(0), slots.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEADS=heads, KV_HEADS=kv_heads, DIM=dim, ROWS=tile, PRECISION=_precision(x),
            NORM=norm_weight is not None, SCALED=squares is not None, **shape, **pdl,
        )  # fmt: skip

    # rewriting the same cache entries while the shapes are timed changes nothing
    key = ("qkv_rope_cache", heads, kv_heads, dim, features, tile, x.dtype, x.device)  # BLOCK_N ≤ d
    launch(_block_shape(key, launch, _rope_candidates(tile, dim)))
    return q


@qkv_rope_cache.register_fake
def _(x, weight, norm_weight, eps, cos, sin, k_cache, v_cache, slots, squares=None):
    kv_heads, dim = k_cache.shape[2:]
    return x.new_empty(*slots.shape, weight.shape[0] // dim - 2 * kv_heads, dim)


def _rope_candidates(tile: int, dim: int) -> list[dict]:
    """`_candidates` that `qkv_rope_cache` takes (every tile has some: d ≥ 16, `fits_qkv_rope_cache`):
    whole rotary pairs."""
    return [c for c in _candidates(tile) if holds_rotary_pairs(c, dim)]


def holds_rotary_pairs(shape: dict, dim: int) -> bool:
    """Whether a block shape's blocks hold whole rotary pairs of one head of size `dim`: BLOCK_N / 2
    dividing d / 2, i.e. BLOCK_N from 2 to d dividing d."""
    return 2 <= shape["BLOCK_N"] <= dim and dim % shape["BLOCK_N"] == 0


def fits_qkv_rope_cache(out_features: int, dim: int, kv_heads: int) -> bool:
    """Whether `qkv_rope_cache` takes a q|k|v map of `out_features` for this head size (a power of
    2 of at least 16, whole blocks of pairs for every row tile) with at least one query head."""
    return (
        dim >= 16 and dim & (dim - 1) == 0 and out_features % dim == 0 and out_features // dim > 2 * kv_heads
    )


def tuned_configs() -> dict[str, dict]:
    """The block shape chosen so far per kernel, map shape, row tile and dtype (`_name`): what
    `preset_block_shapes` takes back."""
    return {_name(key): shape for key, shape in _tuned.items()}


def _name(key: tuple) -> str:
    """A tuning key by name, without its device: "plain:4096,14336:16:bfloat16" (kernel, the
    map's dimensions, row tile, dtype)."""
    kind, *dims, tile, dtype, _device = key
    return f"{kind}:{','.join(map(str, dims))}:{tile}:{str(dtype).removeprefix('torch.')}"


def preset_block_shapes(shapes: dict[str, dict], source: str = "block shapes") -> None:
    """Use these block shapes (`tuned_configs()` of an earlier process on the same kind of GPU, as
    `bench_verify_cost` writes them under "skinny_configs") instead of timing the candidates: the
    steps then run the same kernels in every process. Timing alone picks among near-ties by noise,
    and which of them a step gets moves its time: on one H200 the 8-token verify at batch 1 took
    4.68 ms with down_proj's 16-row tile at (32, 256, 4, 4) in three processes and 4.71–4.79 ms
    with the other picks in six (docs/benchmarks.md, run 10). Each shape must be one the tuning
    could have chosen for its row tile; `source` names the file in the error."""
    fields = set(_candidates(1, gpu=True)[0])
    for name, shape in shapes.items():
        parts = name.split(":")
        if len(parts) != 4 or not parts[2].isdigit():
            raise ValueError(f"{source}: block shape {name!r}: not kernel:dims:row tile:dtype")
        tile = int(parts[2])
        if not isinstance(shape, dict) or set(shape) != fields:
            raise ValueError(
                f"{source}: block shape {name!r}: fields {sorted(fields)} expected, got {shape!r}"
            )
        if shape not in _candidates(tile, gpu=True):
            raise ValueError(f"{source}: block shape {name!r}: {shape} is not a candidate for {tile} rows")
    _preset.update(shapes)


def load_block_shapes(path: str) -> int:
    """`preset_block_shapes` from a JSON file: a benchmark's result (its "skinny_configs") or the
    mapping alone. Returns how many."""
    import json

    with open(path) as f:
        data = json.load(f)
    shapes = data.get("skinny_configs", data) if isinstance(data, dict) else data
    if not isinstance(shapes, dict):
        raise ValueError(f"{path}: block shapes: a mapping of name to shape expected")
    preset_block_shapes(shapes, path)
    return len(shapes)


LINEAR_KERNELS = ("auto", "cublas", "skinny")
_linear_kernel = "auto"
_folds = True
_tile_activation = True
_tile_norm = False
IN_GRAPHS = False
"""`use_linear_kernel`'s in_graphs by default."""
_in_graphs = IN_GRAPHS
_recording = False  # inside `recording_graph()`


def use_linear_kernel(
    name: str,
    folds: bool = True,
    tile_activation: bool = True,
    tile_norm: bool = False,
    in_graphs: bool = IN_GRAPHS,
) -> None:
    """Which kernel `project` runs for a map of at most `MAX_ROWS` rows in 16 bits on CUDA:
    "cublas" (`F.linear`), "skinny" (`skinny_linear`), or "auto", the default: "skinny" inside
    compiled layers, "cublas" elsewhere (eager layers are bound by launches, not reads).
    in_graphs: with "auto", also "skinny" for every eager map of a step recorded as a CUDA graph
    (`recording_graph`: the speculative loop's draft, its lm_head included; a target's layers too
    where they run eager, not compiled): a graph replays their launches at no host cost, which
    leaves the maps bound by reads, as in compiled layers. (An explicit "skinny" takes the draft's
    lm_head, as every `project`, whether recorded or not.)
    folds: whether the skinny maps also take the layer's work around them (the RMSNorms, the
    rotary and cache writes after q|k|v, SiLU·up, the residual adds: `project`, `project_mlp`,
    `project_qkv`); off, that work runs in the compiled layer's own kernels.
    tile_activation: with folds, whether `project_mlp` computes a tile's SiLU·up in gate_up's
    epilogue (`silu_gate_up`); off, in the compiled layer's own kernel. On by default: on an H100
    it made the 8B verifies of 2-8 tokens 0.7-2.5 % faster at batch 1 and the decode step and
    verifies 1.0-2.3 % faster at batch 8 (docs/benchmarks.md, run 11; `speed_run.sh`'s ab_* and
    ta_* items), and with the block shapes given, 1.1-1.4 % at both batches (run 12); the kernel
    checks run it on and off.
    tile_norm: with folds, whether a tile's RMSNorm between two maps is split between them
    (`project`'s norm_after, `NormedRows`: o_proj and gate_up, and down_proj and the next layer's
    q|k|v): the first writes h · g and its sums of squares, the second scales its sums by 1 / rms;
    off, the norm runs in the compiled layer's own kernel.
    Off by default: on an H100 it changed batch 1 by under 1 % and made batch 8's 8-token verify
    4 % slower; with SiLU·up in the epilogue and the tiles' PDL, the verifies of 2-8 tokens were
    6-14 % slower (run 11, `bench_verify_cost --tile-norm`)."""
    global _linear_kernel, _folds, _tile_activation, _tile_norm, _in_graphs
    if name not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel {name!r}: one of {', '.join(LINEAR_KERNELS)}")
    _linear_kernel, _folds, _tile_activation, _tile_norm = name, folds, tile_activation, tile_norm
    _in_graphs = in_graphs


@contextlib.contextmanager
def recording_graph():
    """Around a CUDA graph's warm-up and capture (`use_linear_kernel`'s in_graphs): the warm-up,
    outside the capture, is where the eager maps' block shapes are timed."""
    global _recording
    before, _recording = _recording, True
    try:
        yield
    finally:
        _recording = before


def graphed_eager_maps() -> bool:
    """Whether "auto" takes a recorded step's eager maps to the skinny kernels (`use_linear_kernel`'s
    in_graphs)."""
    return _in_graphs and _linear_kernel == "auto"


def splits_tile_norms() -> bool:
    """Whether `use_linear_kernel` asked for a tile's norms split between maps (its tile_norm)."""
    return _folds and _tile_norm and _linear_kernel != "cublas"


def project(
    linear: torch.nn.Linear,
    x: torch.Tensor,
    norm: RMSNorm | None = None,
    residual: torch.Tensor | None = None,
    norm_after: RMSNorm | None = None,
) -> torch.Tensor | NormedRows:
    """`residual + linear(norm(x))` (a None left out), through `skinny_linear` where
    `use_linear_kernel` says so: a plain bias-free `nn.Linear` (not an FP8 or tensor-parallel one,
    whose modules run their own kernels) on CUDA, 16-bit, with at most `MAX_ROWS` rows. The norm
    and the residual go into its kernel where they fold (`use_linear_kernel`), and are their own
    operations otherwise (a few fp32 rows on a CPU: `cpu_linear.apply_linear`). norm_after: the
    RMSNorm the caller applies to the result next (it passes it on to `project_mlp`); where a tile
    of rows splits it between the maps (`use_linear_kernel`'s tile_norm) the result is
    `NormedRows`."""
    if not _runs_skinny(linear, x):
        return _added(residual, apply_linear(linear, x if norm is None else norm(x)))
    x, norm = _normed_unless_folded(norm, x)
    if not _folds_residual(residual, x):
        return _added(residual, skinny_linear(x, linear.weight, False, None, *_norm_args(norm)))
    if _splits_norm(norm_after, linear.out_features, x) and norm is None:
        return NormedRows(*skinny_linear_norm_out(x, linear.weight, residual, norm_after.weight))
    return skinny_linear(x, linear.weight, False, residual, *_norm_args(norm))


def project_gated(
    linear: torch.nn.Linear,
    gate_up: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_after: RMSNorm | None = None,
) -> torch.Tensor | NormedRows:
    """`residual + linear(silu(gate) · up)` of gate_up = [gate | up] (a gated MLP's down_proj;
    no residual: the map alone). Where `project` would run `skinny_linear` and fold, the residual is
    added in its epilogue, and for one row the activation is computed in its loads. norm_after:
    as `project`'s."""
    if _runs_skinny(linear, gate_up) and _folds and _one_row(gate_up):
        if _folds_residual(residual, gate_up):
            return skinny_linear(gate_up, linear.weight, True, residual)
        return _added(residual, skinny_linear(gate_up, linear.weight, True))
    gate, up = gate_up.chunk(2, dim=-1)
    return project(linear, torch.nn.functional.silu(gate) * up, residual=residual, norm_after=norm_after)


def project_qkv(
    linear: torch.nn.Linear,
    x: torch.Tensor | NormedRows,
    norm: RMSNorm | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """q of `qkv_rope_cache` (k and v written into the caches) where the skinny maps run, fold,
    and take this map, norm and cache; None where they do not: the caller projects and writes
    (x may come with half of its norm done, `NormedRows`: the kernel then does the rest)."""
    kv_heads, dim = k_cache.shape[2:]
    rows = residual_stream(x)
    if not (
        _runs_skinny(linear, rows)
        and _folds
        and fits_qkv_rope_cache(linear.out_features, dim, kv_heads)
        and k_cache.dtype == v_cache.dtype == rows.dtype
    ):
        return None
    if isinstance(x, NormedRows):
        return qkv_rope_cache(
            x.scaled, linear.weight, None, norm.eps, cos, sin, k_cache, v_cache, slots, x.squares
        )
    x, norm = _normed_unless_folded(norm, x)
    return qkv_rope_cache(x, linear.weight, *_norm_args(norm), cos, sin, k_cache, v_cache, slots)


def project_mlp(
    gate_up: torch.nn.Linear,
    down: torch.nn.Linear,
    x: torch.Tensor | NormedRows,
    norm: RMSNorm | None = None,
    residual: torch.Tensor | None = None,
    norm_after: RMSNorm | None = None,
) -> torch.Tensor | NormedRows:
    """`residual + down(silu(gate) · up)` of [gate | up] = gate_up(norm(x)), a gated MLP (a None
    left out). Where the skinny maps run and fold: one row takes the norm into gate_up's loads and
    the activation into down_proj's (`project_gated`); a tile of rows the activation into
    gate_up's epilogue (`silu_gate_up`), after its norm (`_normed_unless_folded`), or with the
    norm's second half where x comes with its first (`NormedRows`). norm_after: as `project`'s,
    for down_proj."""
    if isinstance(x, NormedRows) and not _runs_skinny(gate_up, x.scaled):
        x = x.rows  # the norm runs on its own after all
    if isinstance(x, NormedRows):  # the map before did half of the norm: gate_up does the rest
        if _tile_activation and fits_silu_gate_up(gate_up.out_features):
            activation = silu_gate_up(x.scaled, gate_up.weight, x.squares, norm.eps)
            return project(down, activation, residual=residual, norm_after=norm_after)
        gate_up_out = skinny_linear(x.scaled, gate_up.weight, squares=x.squares, eps=norm.eps)
        return project_gated(down, gate_up_out, residual, norm_after)
    if (
        _tile_activation
        and not _one_row(x)
        and _runs_skinny(gate_up, x)
        and _folds
        and fits_silu_gate_up(gate_up.out_features)
    ):
        x, _ = _normed_unless_folded(norm, x)
        return project(down, silu_gate_up(x, gate_up.weight), residual=residual, norm_after=norm_after)
    return project_gated(down, project(gate_up, x, norm), residual, norm_after)


def _added(residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    return out if residual is None else residual + out


def _norm_args(norm: RMSNorm | None) -> tuple:
    """The kernels' (norm_weight, eps)."""
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


def _normed_unless_folded(
    norm: torch.nn.Module | None, x: torch.Tensor
) -> tuple[torch.Tensor, RMSNorm | None]:
    """(x, norm) where the kernel folds the norm; else (norm(x), None): a norm it does not take
    (more than one row, another kind of norm, an nn.Identity) runs first, as its own operation."""
    if norm is None or _folds_norm(norm, x):
        return x, norm
    return norm(x), None


def _folds_norm(norm: RMSNorm | None, x: torch.Tensor) -> bool:
    # the project's RMSNorm only (a subclass may compute another norm), over the map's features,
    # of one row (`_tile_product` takes x as loaded)
    return _folds and type(norm) is RMSNorm and norm.weight.shape == x.shape[-1:] and _one_row(x)


def _fits_squares(squares: torch.Tensor | None, features: int, rows: int) -> bool:
    """Whether a map of `features` inputs and `rows` rows takes these sums of squares of its x
    (none, or [features / 16, rows] for a tile: `skinny_linear_norm_out`'s layout)."""
    return squares is None or (rows > 1 and features % 16 == 0 and squares.shape == (features // 16, rows))


def _splits_norm(norm: RMSNorm | None, features: int, x: torch.Tensor) -> bool:
    # the norm after a map of `features` outputs, for a tile of rows (`NormedRows`): the project's
    # RMSNorm only, over whole groups of 16 features (`skinny_linear_norm_out`)
    return (
        _folds
        and _tile_norm
        and type(norm) is RMSNorm
        and norm.weight.shape == (features,)
        and features % 16 == 0
        and not _one_row(x)
    )


def _one_row(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1]


def _folds_residual(residual: torch.Tensor | None, x: torch.Tensor) -> bool:
    # in the map's own dtype only: a wider residual stream keeps PyTorch's promotion
    return _folds and residual is not None and residual.dtype == x.dtype


def _runs_skinny(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    kernel = _linear_kernel
    if kernel == "auto":
        # (compiling first: a traced layer reads no flag, so its graph has no guard on them)
        kernel = "skinny" if torch.compiler.is_compiling() or (_in_graphs and _recording) else "cublas"
    return kernel == "skinny" and _plain(linear) and _fits(x)


def _plain(linear: torch.nn.Module) -> bool:
    return plain_linear(linear) and linear.bias is None


def _fits(x: torch.Tensor) -> bool:
    return (
        runs_on(x.device.type)
        and x.dtype in (torch.bfloat16, torch.float16) + ((torch.float32,) if INTERPRETED else ())
        and x.numel() <= MAX_ROWS * x.shape[-1]
    )
