"""Split-key cached attention for a few new tokens per row (decode and verify steps), in Triton.

Query s of row b sees the keys 0 … lengths[b] + s of its cache: the consecutive placement of
`attention.cache_slots`, not a token tree's. The keys a row has are split over `splits` thread
blocks per K/V head (flash-decoding): each block attends over its share with every query head of
the K/V head's group and every new token as the rows of one tile (group · S ≤ `MAX_ROWS`), and
writes a partial output and its log-sum-exp; a second kernel merges the shares. Each row reads
only the keys it has (the split is computed on the device from `lengths`, so a CUDA graph holds
it at any length), each K/V head once for its whole group.

Why: at batch 1 SDPA's masked kernels (cuDNN's) run a few thread blocks per layer and read the
cache at 0.45 TB/s on an H100, 0.30 ms of a 6.46 ms decode step at the Llama-3.1-8B shape
(docs/benchmarks.md, "#36 on an H100"); a verify's few extra queries cost SDPA and FlexAttention
more again. Runs on CUDA, and on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`: the tests).
"""

from __future__ import annotations

import functools
import math

import torch

from inference_ref.triton_support import launch_options, tl, triton

if triton is not None:
    from inference_ref.triton_support import after_previous_kernel

MAX_ROWS = 64
"""The most query rows (query heads per K/V head × new tokens) one tile holds."""
BLOCK_KEYS = 64
"""Keys per loop step of a thread block."""


def fits(new: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `new` tokens per row with this head layout fit one tile (and the head size one
    block: a power of 2, at least the 16 `tl.dot` takes)."""
    return new * (heads // kv_heads) <= MAX_ROWS and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _rows_block(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))  # tl.dot takes tiles of 16 rows or more


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _multiprocessor_count(device: torch.device) -> int:
    # 16 under the interpreter: enough that the checks' small grids split their keys in shares
    return _multiprocessors(device.index or 0) if device.type == "cuda" else 16


def split_count(batch: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Thread blocks per (row, K/V head): as many as one wave of one per multiprocessor holds, none
    with fewer than `BLOCK_KEYS` keys of the cache's capacity. Two per multiprocessor (rounded up)
    cost more on an H100 (2026-12-06, 8B shape, 1k-token cache): at batch 8, 5 shares (2.4 waves)
    against 2 made the 8-token verify 6.90 ms against 6.67 and the decode 6.42 against 6.37, and
    3 shares (1.5 waves) 6.85; batches 2 and 4 gained 0.07-0.09 ms, batch 1 takes 16 either way.
    The merge reads every share's fp32 partial output, so fewer shares also read less. Static
    (shapes and the device only), so one compiled kernel and one graph serve every length."""
    one_wave = _multiprocessor_count(device) // (batch * kv_heads)
    return max(1, min(one_wave, -(-max_keys // BLOCK_KEYS)))


if triton is not None:

    @triton.jit
    def _split_kv_attention_partial(
        Q, K, V, Lengths, Out, Lse,
        stride_lb, stride_qb, stride_qs, stride_qh,
        stride_kb, stride_kl, stride_kh,
        stride_vb, stride_vl, stride_vh,
        new, scale_log2,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr,
        ROWS: tl.constexpr, KEYS: tl.constexpr, DIM: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # One (row, K/V head, share of the keys). Tile row r: new token r // GROUP, query head
        # kv_head · GROUP + r % GROUP. PDL: q and the new cache entries are read after the wait.
        after_previous_kernel(PDL)
        pair, split = tl.program_id(0), tl.program_id(1)
        b, kv_head = (pair // KV_HEADS).to(tl.int64), pair % KV_HEADS  # b · stride: past 2³¹ at B·L > 2M
        r = tl.arange(0, ROWS)
        s = r // GROUP
        head = kv_head * GROUP + r % GROUP
        d = tl.arange(0, DIM)
        q_at = Q + b * stride_qb + s[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_at, mask=(s < new)[:, None], other=0.0)
        length = tl.load(Lengths + b * stride_lb)
        sees = length + s  # the last key each tile row sees
        total = length + new
        share = tl.cdiv(tl.cdiv(total, SPLITS), KEYS) * KEYS
        start = split * share
        end = tl.minimum(start + share, total)
        top = tl.full([ROWS], float("-inf"), tl.float32)  # running maximum, in log2 units
        weight = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score − top)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        for first in range(start, end, KEYS):
            n = first + tl.arange(0, KEYS)
            there = n < end
            k = tl.load(K + b * stride_kb + n[:, None] * stride_kl + kv_head * stride_kh + d[None, :],
                        mask=there[:, None], other=0.0)  # fmt: skip
            # V issued with K, not after the scores: a share is often one step of the loop, and
            # its time the latency of these loads (4.4 µs a layer at 8B, batch 1, on an H200)
            v = tl.load(V + b * stride_vb + n[:, None] * stride_vl + kv_head * stride_vh + d[None, :],
                        mask=there[:, None], other=0.0)  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            scores = tl.where((n[None, :] <= sees[:, None]) & there[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)  # no key seen yet
            p = tl.exp2(scores - safe_top[:, None])
            rescale = tl.exp2(top - safe_top)
            weight = weight * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            top = new_top
        seen = weight > 0
        at = (pair * SPLITS + split) * ROWS + r
        tl.store(Out + at[:, None] * DIM + d[None, :], acc / tl.where(seen, weight, 1.0)[:, None])
        tl.store(Lse + at, tl.where(seen, top + tl.log2(tl.where(seen, weight, 1.0)), float("-inf")))

    @triton.jit
    def _split_kv_attention_merge(
        Part, Lse, Out,
        stride_ob, stride_os, stride_oh,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
        ROWS: tl.constexpr, DIM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # One tile row of one (row, K/V head): its shares' outputs weighted by their exp2(lse),
        # all shares loaded at once. One row a program: taking a token's whole group of query
        # heads instead (a quarter of the programs at batch 8 × 8 tokens) left the merge's time
        # as it was on an H100 (0.228 ms a step, 2026-12-06).
        after_previous_kernel(PDL)
        pair, r = tl.program_id(0), tl.program_id(1)
        b, kv_head = (pair // KV_HEADS).to(tl.int64), pair % KV_HEADS
        s, head = r // GROUP, kv_head * GROUP + r % GROUP
        d = tl.arange(0, DIM)
        shares = tl.arange(0, SPLITS_POW2)
        at = (pair * SPLITS + shares) * ROWS + r
        lse = tl.load(Lse + at, mask=shares < SPLITS, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # 0 for a share that saw no key
        part = tl.load(Part + at[:, None] * DIM + d[None, :], mask=(shares < SPLITS)[:, None], other=0.0)
        o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_ob + s * stride_os + head * stride_oh + d, o.to(Out.dtype.element_ty))


@torch.library.custom_op("inference_ref::split_kv_attention", mutates_args=())
def split_kv_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """q [B, S, Hq, d]; caches [B, K, Hkv, d] already holding the S new entries at lengths[b] …
    lengths[b] + S − 1 (int64 [B], any stride) → [B, S, Hq, d]: query s sees keys 0 … lengths[b] + s.
    A custom op: torch.compile calls it as it is, and a CUDA graph holds its two launches."""
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    batch, new, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    rows = _rows_block(new * group)
    splits = split_count(batch, kv_heads, k_cache.shape[1], q.device)
    part = torch.empty(batch * kv_heads * splits * rows, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch * kv_heads * splits * rows, device=q.device, dtype=torch.float32)
    out = q.new_empty(q.shape)  # contiguous, as the fake below says
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: not used by 16-bit dots
    pdl = launch_options(q.device, batch * new)
    _split_kv_attention_partial[(batch * kv_heads, splits)](
        q, k_cache, v_cache, lengths, part, lse,
        lengths.stride(0), q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        new, math.log2(math.e) / math.sqrt(dim),
        KV_HEADS=kv_heads, GROUP=group, SPLITS=splits, ROWS=rows, KEYS=BLOCK_KEYS, DIM=dim,
        PRECISION=precision, **pdl,
    )  # fmt: skip
    _split_kv_attention_merge[(batch * kv_heads, new * group)](
        part, lse, out, out.stride(0), out.stride(1), out.stride(2),
        KV_HEADS=kv_heads, GROUP=group, SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits),
        ROWS=rows, DIM=dim, **pdl,
    )  # fmt: skip
    return out


@split_kv_attention.register_fake
def _(q, k_cache, v_cache, lengths):
    return q.new_empty(q.shape)
