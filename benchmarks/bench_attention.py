"""The verify step's attention alone (#36: a verify of 2–8 tokens costs 1.28× a decode step at the
8B shape, batch 1, and the extra is paid at the switch from one token to two): n new query tokens
per row against a filled static KV cache, 32 layers' worth (each its own cache, so nothing stays
in L2), replayed as one CUDA graph, for each way of computing it:

  gqa_sdpa      SDPA with `enable_gqa` and the [B, 1, n, K] mask (inference_ref's one-token path)
  folded_sdpa   the query heads sharing a K/V head folded into the query length, the mask
                repeated per head: SDPA without GQA (inference_ref's path for n > 1)
  matmul        the folded queries through two batched matmuls and an fp32 softmax
  flex          inference_ref's FlexAttention kernel (`attention._flex_compiled`): GQA native, the
                dense mask read per element, every key block visited (what a static cache needs)
  flex_lengths  FlexAttention with a block mask built once from the rows' lengths (blocks past
                them skipped): what this benchmark measured first, 2026-12-04

Every variant is first checked against a float32 reference on the same inputs.

    python -m benchmarks.bench_attention --shape llama3_8b
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_verify_cost import CONTEXT, graphed
from benchmarks.common import DEVICE, DTYPE, shape, strict_compile, write_result
from inference_ref import attention
from inference_ref.attention import fold_groups, fold_mask, unfold_groups

LAYERS = 32
NEW_TOKENS = (1, 2, 4, 8)


def reference(q, k, v, mask):
    """fp32 attention, K/V heads repeated: what every variant must compute."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.float().repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    scores = q.float().transpose(1, 2) @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def gqa_sdpa(q, k, v, mask):
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return o.transpose(1, 2)


def folded(q, k, v, mask, sdpa: bool):
    """The query heads sharing a K/V head folded into the query length (inference_ref's layout)."""
    dim, kv_heads = q.shape[-1], k.shape[2]
    folded = fold_groups(q, kv_heads)
    mask = fold_mask(mask, q.shape[2] // kv_heads)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if sdpa:
        o = F.scaled_dot_product_attention(folded, kt, vt, attn_mask=mask)
    else:
        scores = (folded @ kt.transpose(-1, -2)).float() * dim**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        o = scores.softmax(-1).to(q.dtype) @ vt
    return unfold_groups(o, q.shape[1])


def folded_sdpa(q, k, v, mask):
    """inference_ref.attention.cached_attention's path for n > 1, here for n = 1 too."""
    return folded(q, k, v, mask, sdpa=True)


def matmul(q, k, v, mask):
    return folded(q, k, v, mask, sdpa=False)


def flex_lengths_variant(lengths, new, kv_len):
    """FlexAttention over the static cache: row b's new token i sees entries ≤ lengths[b] + i."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(b, h, q_idx, kv_idx):
        return kv_idx <= lengths[b] + q_idx

    block = create_block_mask(visible, lengths.shape[0], None, new, kv_len, device=lengths.device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex_lengths(q, k, v, mask):
        o = compiled(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block, enable_gqa=True
        )
        return o.transpose(1, 2)

    return flex_lengths


def inputs(cfg, batch, new, kv_len, layers, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(batch, new, heads, dim, device=DEVICE, dtype=DTYPE, generator=g)
    caches = [
        tuple(
            torch.randn(batch, kv_len, kv_heads, dim, device=DEVICE, dtype=DTYPE, generator=g) for _ in "kv"
        )
        for _ in range(layers)
    ]
    # each row's committed entries differ (CONTEXT ± 64), the new ones follow them
    lengths = CONTEXT - 64 + torch.randint(0, 128, (batch,), device=DEVICE, generator=g)
    pos = lengths[:, None] + torch.arange(new, device=DEVICE)[None]
    mask = (torch.arange(kv_len, device=DEVICE)[None, None] <= pos[:, :, None])[:, None]  # [B,1,n,K]
    return q, caches, lengths, mask


@torch.inference_mode()
def measure(cfg, batch, new, layers) -> dict:
    kv_len = CONTEXT + 65
    q, caches, lengths, mask = inputs(cfg, batch, new, kv_len, layers)
    variants = {
        "gqa_sdpa": gqa_sdpa,
        "folded_sdpa": folded_sdpa,
        "matmul": matmul,
        "flex": attention._flex_compiled,
    }
    try:
        variants["flex_lengths"] = flex_lengths_variant(lengths, new, kv_len)
    except Exception as e:  # noqa: BLE001 - an unsupported build is reported, not fatal
        print(f"flex_lengths unavailable: {type(e).__name__}: {e}", flush=True)
    want = reference(q, *caches[0], mask)
    row = {}
    for name, fn in variants.items():
        try:
            err = ((fn(q, *caches[0], mask).float() - want).abs().max() / want.abs().max()).item()
            ms = graphed(lambda fn=fn: [fn(q, k, v, mask) for k, v in caches]) if DEVICE == "cuda" else None
        except Exception as e:  # noqa: BLE001
            print(f"{name} failed at batch {batch}, n {new}: {type(e).__name__}: {e}", flush=True)
            continue
        row[name] = {"ms_per_layers": ms, "rel_err": err}
    print(batch, new, row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new", type=int, nargs="+", default=list(NEW_TOKENS))
    p.add_argument("--layers", type=int, default=LAYERS)
    args = p.parse_args()
    strict_compile()
    cfg = shape(args.shape)
    rows = {str(b): {str(n): measure(cfg, b, n, args.layers) for n in args.new} for b in args.batches}
    write_result(
        f"attention_{args.shape}",
        {
            "command": "python -m benchmarks.bench_attention " + " ".join(sys.argv[1:]),
            "context": CONTEXT,
            "layers": args.layers,
            "ms": rows,
        },
    )


if __name__ == "__main__":
    main()
