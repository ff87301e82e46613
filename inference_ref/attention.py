"""Attention kernels for the two layouts the models run in.

Packed: a flat token stream [T, heads, d] of many sequences, `cu_seqlens` [B+1] marks their
boundaries; causal inside each sequence, nothing across. On CUDA this is one varlen
FlashAttention call; elsewhere a loop of SDPA calls, one per sequence (exact, and fast enough on CPU).

Cached: queries [B, S, heads, d] for S new tokens per row, against a KV cache whose row b holds
`lengths[b]` committed entries followed by the S new ones; or, for the nodes of a token tree, at
slots and positions with a mask of their own (`Placement`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_ref.split_kv_attention import fits as split_kv_fits
from inference_ref.triton_support import runs_on


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


_VARLEN = _varlen_kernel()
_varlen_failed: str | None = None  # why the varlen kernel was given up on, once, if it was
# FlashAttention shares each K/V head among its query group itself; torch ≥ 2.13 asks for it by
# name. Where a build refuses un-repeated K/V, K/V are repeated from then on.
_GQA_OPTION = (
    {"enable_gqa": True} if _VARLEN and "enable_gqa" in inspect.signature(_VARLEN).parameters else {}
)
_gqa_native = True


# Not traced by torch.compile (`CausalLM.compile_layers`): the kernel choice and its fallbacks are
# Python state; a compiled layer runs this as a graph break between its fused halves.
@torch.compiler.disable
def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """q [T, Hq, d], k/v [T, Hkv, d] → [T, Hq, d], causal within each packed sequence."""
    global _varlen_failed
    # FlashAttention takes 16-bit inputs only; fp32 (parity tests) goes to SDPA without marking
    # the kernel as failed for the 16-bit calls that follow.
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.is_cuda and half and _VARLEN is not None and _varlen_failed is None:
        try:
            return _varlen(q, k, v, cu_seqlens, max_len)
        except torch.OutOfMemoryError:
            raise  # a property of this batch, not of the kernel
        except (RuntimeError, TypeError, NotImplementedError) as e:
            # An older build without this dtype, head size or signature: fall back for good.
            _varlen_failed = f"{type(e).__name__}: {e}"
    return _sdpa_per_sequence(q, k, v, cu_seqlens)


def packed_kernel() -> str:
    """Which kernel `packed_causal_attention` uses on CUDA (reported by benchmarks)."""
    if _VARLEN is None or _varlen_failed is not None:
        return f"SDPA per sequence ({_varlen_failed or 'no varlen_attn in this torch'})"
    gqa = "K/V heads shared in the kernel" if _gqa_native else "K/V repeated per query head"
    return f"varlen_attn (FlashAttention) on CUDA, {gqa}"


def _varlen(q, k, v, cu_seqlens, max_len, **options):
    global _gqa_native
    cu = cu_seqlens.to(torch.int32)
    group = q.shape[1] // k.shape[1]
    if group > 1 and _gqa_native:
        try:
            return _VARLEN(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **_GQA_OPTION, **options)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):
            # GQA's fault only if the same call with repeated K/V works (otherwise that raises)
            out = _varlen_repeated(q, k, v, cu, max_len, group, **options)
            _gqa_native = False
            return out
    return _varlen_repeated(q, k, v, cu, max_len, group, **options)


def _varlen_repeated(q, k, v, cu, max_len, group: int, **options):
    if group > 1:  # a copy of K/V per query head: the kernel's most portable signature
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _VARLEN(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **options)


def varlen_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal varlen FlashAttention (CUDA, 16-bit) returning (out [T, Hq, d], the log-sum-exp of
    each query's scaled scores [T, Hq] in fp32); forward only (the kernel gives no gradient of
    the log-sum-exp). None where this torch's kernel cannot (the caller then falls back)."""
    if _VARLEN is None or not q.is_cuda:
        return None
    from torch.nn.attention.varlen import AuxRequest

    tokens, heads = q.shape[:2]
    if tokens == heads:  # the log-sum-exp's layout could not be told from its shape
        return None
    try:
        out, lse = _varlen(q, k, v, cu_seqlens, max_len, return_aux=AuxRequest(lse=True))
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    if lse.shape == (heads, tokens):  # FlashAttention's own layout
        lse = lse.transpose(0, 1)
    return out, lse.float()


def _sdpa_per_sequence(q, k, v, cu_seqlens):
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


KEY_BLOCK = 128
"""Eager cached attention reads keys in multiples of this many (see `cache_slots`)."""


def cache_slots(
    lengths: torch.Tensor, max_len: int, new: int, static: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, new] the next `new` tokens of each row take after its `lengths[b]` committed
    entries, and their attention mask. Keys run to the longest row rounded up to a `KEY_BLOCK`;
    `static` attends over the whole cache (masked) instead: no host sync and fixed shapes, as a
    CUDA graph needs."""
    slots = lengths[:, None] + torch.arange(new, device=lengths.device)
    if static:
        return slots, cache_mask(lengths, new, max_len)
    return slots, cache_mask(lengths, new, key_length(int(slots.max()) + 1, max_len))


def key_length(needed: int, max_len: int) -> int:
    """Keys an eager cached attention reads: `needed` rounded up to a whole `KEY_BLOCK`. Attention
    backends plan (and cache plans) per exact shape, and a key length that grew by one every step
    would be a new plan every step. (On the H200 this was not what made the eager loop slow: host
    dispatch was.) The extra keys are masked out."""
    return min(-(-needed // KEY_BLOCK) * KEY_BLOCK, max_len)


def cache_mask(lengths: torch.Tensor, new: int, key_len: int) -> torch.Tensor:
    """[B, 1, new, key_len] bool: query s of row b sees keys 0 … lengths[b] + s."""
    keys = torch.arange(key_len, device=lengths.device)
    limit = lengths[:, None] + torch.arange(new, device=lengths.device)[None, :]
    return (keys[None, None, :] <= limit[:, :, None]).unsqueeze(1)


@dataclass
class Placement:
    """Where a cached forward puts its S new tokens per row, when they are not one consecutive
    run (`cache_slots`) but the nodes of a token tree: the cache slots they are written to [B, S],
    their rope positions [B, S] and the keys each attends to (mask [B, 1, S, K]). Passed to the
    layers, a mask of None means a consecutive run for `split_kv_attention`: token s sees the
    keys up to its own slot."""

    slots: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None


def tree_placement(
    lengths: torch.Tensor, max_len: int, offset: int, sees: torch.Tensor, positions: torch.Tensor
) -> Placement:
    """S tree nodes per row written at slots `lengths + offset + s`. Each sees every committed
    entry (< lengths[b]) and, of the W scratch slots `lengths + 0 … W − 1` after them, those
    `sees` [B, S, W] marks (its ancestors and itself: the path that a sequential decode would
    have in its cache). `positions` [B, S]: rope positions (the committed length plus the depth)."""
    batch, new, width = sees.shape
    slots = lengths[:, None] + offset + torch.arange(new, device=lengths.device)
    keys = torch.arange(key_length(int(lengths.max()) + width, max_len), device=lengths.device)
    scratch = keys[None, :] - lengths[:, None]  # [B, K]: a key's place among the scratch slots
    seen = sees.gather(2, scratch.clamp(0, width - 1)[:, None, :].expand(batch, new, -1))
    mask = (scratch < 0)[:, None, :] | (seen & (scratch >= 0)[:, None, :] & (scratch < width)[:, None, :])
    return Placement(slots, positions, mask.unsqueeze(1))


CACHED_KERNELS = ("auto", "sdpa", "flex", "mixed", "split")
_cached_kernel = "auto"
FLEX_MAX_NEW = 8
"""The most new tokens per row "mixed" gives FlexAttention: the range measured against SDPA at
every batch (2–8 tokens at batches 1–64, 2026-12-04). Such steps are verifies, and the rare prompt
or chat-template tail that short; longer queries (prefills, large trees) keep SDPA."""


def use_cached_kernel(name: str) -> None:
    """Which kernel `cached_attention` runs (`kernel_for`):

    - "sdpa": SDPA for every call;
    - "flex": FlexAttention for every call (compiled; `flex_cached_attention`);
    - "mixed": SDPA for one-token steps (decoding), flex for 2 to `FLEX_MAX_NEW` tokens (verifying);
    - "split": the split-key Triton kernel (`split_kv_attention`) for the consecutive steps of a
      kind that has it (`uses_split_kv`), "mixed" for the rest (token trees, prefills);
    - "auto", the default: "split" in compiled layers on CUDA (`CausalLM.compile_layers`), "sdpa"
      elsewhere.

    Whole steps on an H100 at the Llama-3.1-8B shape, compiled layers, graphed (2026-12-05,
    docs/benchmarks.md): "split" with the skinny linear maps decodes at batch 1 in 5.88 ms (76.9 %
    of the weight-read limit) against "mixed"'s 6.49 with cuBLAS, and its verifies of 2–8 tokens
    at batches 1 and 8 cost 1.01–1.08× its decode step. On an H200: 4.49 ms (70.3 %) against
    4.84, 4.36 ms (72.4 %) with the gated down_proj. With the layer folded into the maps (run 4,
    another H100): 5.45 ms (83.0 %) against 5.89 for the maps alone and 6.22 for "mixed" with
    cuBLAS; verifies 1.01–1.10×. On an H200 (run 6, 2026-12-06): 4.27 ms (74.0 %), 4.20 ms
    (75.1 %) with the skinny maps' block shapes added after it, against 4.86 for "mixed" with
    cuBLAS; 8B verifies 1.01–1.10×, 70B verifies of 6–8 tokens at batch 8 1.14–1.20× (run 6).

    Whole steps on the H200 at the Llama-3.1-8B shape, compiled layers, 1k-token cache, graphed
    (`bench_verify_cost`, 2026-12-04; docs/benchmarks.md): flex verifies 2–8 tokens faster than
    SDPA at every batch from 1 to 64 (batch 8: 5.61–6.10 ms against 6.42–6.97), SDPA decodes one
    token faster at every batch (batch 32: 6.10 ms against 7.27), hence "mixed". Eager layers
    keep SDPA under "auto": with them flex was measured only with the batch dynamic. With flex,
    compiled steps get one graph per batch size (`static_batch`): more than about four batch sizes
    in one process meet Dynamo's limit of 8 graphs per function. On a CPU flex runs too (Inductor's
    CPU template; the tests compare it with SDPA there), but compiling it there costs more than it
    saves, so "auto" keeps SDPA."""
    global _cached_kernel
    if name not in CACHED_KERNELS:
        raise ValueError(f"cached attention kernel {name!r}: one of {', '.join(CACHED_KERNELS)}")
    _cached_kernel = name


def kernel_for(new: int, device_type: str, compiled: bool, kernel: str | None = None) -> str:
    """ "sdpa" or "flex": what `kernel` (the one chosen by `use_cached_kernel` when None) runs for
    `new` query tokens per row on `device_type`, inside compiled layers or not."""
    kernel = _resolved(kernel or _cached_kernel, device_type, compiled)
    if kernel in ("mixed", "split"):  # "split": what its kernel does not take (`uses_split_kv`)
        return "flex" if 1 < new <= FLEX_MAX_NEW else "sdpa"
    return kernel


def _resolved(kernel: str, device_type: str, compiled: bool) -> str:
    """What "auto" stands for: the measured configuration only, compiled layers on CUDA."""
    if kernel == "auto":
        return "split" if device_type == "cuda" and compiled else "sdpa"
    return kernel


def uses_split_kv(new: int, cfg, device_type: str, compiled: bool) -> bool:
    """Whether a consecutive step of `new` tokens per row of a target shaped `cfg` (its head
    counts and size) runs `split_kv_attention` (the caller passes no mask then): under "split", and
    under "auto" in compiled layers on CUDA, where Triton runs it (CUDA, or its interpreter) and
    the step fits one tile."""
    kernel = _resolved(_cached_kernel, device_type, compiled)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    return kernel == "split" and runs_on(device_type) and split_kv_fits(new, heads, kv_heads, cfg.head_dim)


FLEX_BLOCK = 128
"""FlexAttention's block of keys (and queries): its kernels tile by it."""


def flex_cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`cached_attention` through FlexAttention: GQA inside the kernel (no repeated K/V, no folded
    mask), the mask read element by element from the same [B, 1, S, K] tensor, every key block
    visited (a static cache's shape, whatever the rows' lengths: a CUDA graph can hold it). Its
    decoding kernel splits the keys over thread blocks, where SDPA's masked kernels leave most of
    the GPU idle for a few queries. Runs compiled (`_flex_compiled`); called eagerly, FlexAttention
    materializes the scores."""
    batch, new = q.shape[:2]
    keys = k_cache.shape[1]
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    q_blocks, kv_blocks = -(-new // FLEX_BLOCK), -(-keys // FLEX_BLOCK)
    counts = torch.full((batch, 1, q_blocks), kv_blocks, dtype=torch.int32, device=q.device)
    blocks = torch.arange(kv_blocks, dtype=torch.int32, device=q.device).expand(batch, 1, q_blocks, kv_blocks)

    def visible(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx, kv_idx]

    block_mask = BlockMask.from_kv_blocks(
        counts, blocks, BLOCK_SIZE=FLEX_BLOCK, mask_mod=visible, seq_lengths=(new, keys), **_FORWARD_ONLY
    )
    o = flex_attention(
        q.transpose(1, 2),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        block_mask=block_mask,
        enable_gqa=True,
    )
    return o.transpose(1, 2)


def _forward_only() -> dict:
    """No query-block index for a backward pass (built per call otherwise), where torch has the option."""
    from torch.nn.attention.flex_attention import BlockMask

    options = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in options else {}


_FORWARD_ONLY = _forward_only()
# Dynamic shapes after the first, except the batch (`static_batch`): one graph per batch size, the
# token and key counts dynamic. One static graph per shape would pass Dynamo's limit of 8 compiled
# variants per function within one benchmark (4 batches × 10 token counts), after which
# FlexAttention runs eagerly, unfused, without an error (the benchmarks raise the limit and fail
# past it: `strict_compile`). The mask's values are an input, not a guard (each call's mask is a
# new tensor). Inside compiled layers this is traced inline.
_flex_compiled = torch.compile(flex_cached_attention, dynamic=None)


def cached_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, S, Hq, d]; caches [B, K, Hkv, d] (already holding the new entries); mask [B,1,S,K].
    Where `kernel_for` says flex: `flex_cached_attention`. Otherwise SDPA:

    For S > 1 (a verify, a prefill) the query heads that share a K/V head are folded into the
    query length ([B, Hkv, group·S, d]), as decode kernels do: with a mask and S > 1, SDPA's
    `enable_gqa` falls back to the math path and copies every cached K/V once per query head,
    which made a verify of two tokens cost 2–3× a decode step at batch 32–64 on the H200. A
    one-token step keeps `enable_gqa`, which was the faster of the two there
    (`benchmarks/bench_verify_cost`, docs/benchmarks.md)."""
    if kernel_for(q.shape[1], q.device.type, torch.compiler.is_compiling()) == "flex":
        static_batch(q, k_cache, v_cache, mask)
        return _flex_compiled(q, k_cache, v_cache, mask)
    if q.shape[1] == 1:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
        return o.transpose(1, 2)
    group = q.shape[2] // k_cache.shape[2]
    o = F.scaled_dot_product_attention(
        fold_groups(q, k_cache.shape[2]),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        attn_mask=fold_mask(mask, group),
    )
    return unfold_groups(o, q.shape[1])


def static_batch(x: torch.Tensor, *others: torch.Tensor, compiled: bool = False) -> None:
    """Where the flex kernel serves queries x [B, S, ...] (`kernel_for`; `compiled`: inside the
    compiled layers about to be called), mark the batch (dim 0) of a compiled call's inputs (x and
    `others`) static: one graph per batch size, as engines capture one CUDA graph per batch size.
    FlexAttention takes its decoding kernel (the keys split over thread blocks, for short queries)
    only where the graph knows the batch and head counts
    (torch/_inductor/kernel/flex/flex_decoding.py, `_use_flex_decoding`); with a dynamic batch it
    falls back to the main kernel. That is what a batch of 8 met on the H200 (2026-12-04): a 2-token
    verify at 1.38× a decode step with the batch dynamic, 1.01× with it static. Nothing is marked
    where SDPA serves x, or while tracing (the compiled caller marked its own inputs)."""
    if torch.compiler.is_compiling() or kernel_for(x.shape[1], x.device.type, compiled) != "flex":
        return
    for t in (x, *others):
        torch._dynamo.mark_static(t, 0)


def fold_groups(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, S, Hq, d] → [B, Hkv, group·S, d]: the query heads that share a K/V head, as rows."""
    batch, new, heads, dim = q.shape
    group = heads // kv_heads
    return (
        q.view(batch, new, kv_heads, group, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, kv_heads, group * new, dim)
    )


def unfold_groups(o: torch.Tensor, new: int) -> torch.Tensor:
    """`fold_groups`' inverse: [B, Hkv, group·S, d] → [B, S, Hq, d]."""
    batch, kv_heads, rows, dim = o.shape
    group = rows // new
    return (
        o.view(batch, kv_heads, group, new, dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, new, kv_heads * group, dim)
    )


def fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, 1, S, K] → [B, 1, group·S, K], the rows of `fold_groups`' layout."""
    batch, _, new, keys = mask.shape
    return mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, 1, group * new, keys)
