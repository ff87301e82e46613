"""Attention of the draft head over packed samples, for one or several chained steps.

Step 0 (the target-fed pass) is causal attention inside each packed sample. A chained step j ≥ 1
at position i sees the step-0 keys ≤ i and its own chain's keys of steps 1 … j at the same i:
a diagonal per step. So the causal part is computed once per step with its log-sum-exp, the
diagonal scores elementwise, and the two merged by their log-sum-exps, never building a
T × T × k mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_ref.attention import packed_causal_attention


@dataclass
class Segments:
    """Sample boundaries of a packed batch."""

    cu_seqlens: torch.Tensor  # [B+1] int64
    max_len: int


def head_attention(
    q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], seg: Segments
) -> torch.Tensor:
    """q [T, Hq, d] of the current step; kv: (k, v) [T, Hkv, d] of steps 0 … j → [T, Hq, d]."""
    k0, v0 = kv[0]
    if len(kv) == 1:
        if q.is_cuda and q.dtype == torch.float32:
            # fp32 training without DeepSpeed's bf16: FlashAttention takes 16-bit inputs only, and
            # its fallback (one SDPA call per sample) makes a small head's step CPU-bound. Run it
            # in bf16 as autocast would; the result and the gradients return to fp32.
            half = [t.bfloat16() for t in (q, k0, v0)]
            return packed_causal_attention(*half, seg.cu_seqlens, seg.max_len).float()
        return packed_causal_attention(q, k0, v0, seg.cu_seqlens, seg.max_len)
    out0, lse0 = causal_attention_with_lse(q, k0, v0, seg)
    group = q.shape[1] // k0.shape[1]
    scale = q.shape[-1] ** -0.5
    chain_v = [v.repeat_interleave(group, 1) for _, v in kv[1:]]
    chain_s = [(q * k.repeat_interleave(group, 1)).sum(-1) * scale for k, _ in kv[1:]]
    lse = torch.logsumexp(torch.stack([lse0, *chain_s], -1), -1)
    out = torch.exp(lse0 - lse).unsqueeze(-1) * out0
    for s, v in zip(chain_s, chain_v):
        out = out + torch.exp(s - lse).unsqueeze(-1) * v
    return out.to(q.dtype)


def causal_attention_with_lse(q, k, v, seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention inside each sample, with its log-sum-exp [T, Hq] (fp32), sample by sample."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    work = torch.promote_types(q.dtype, torch.float32)  # fp32 at least, fp64 in tests
    outs, lses = [], []
    bounds = seg.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].transpose(0, 1).to(work)
        ks = k[start:end].repeat_interleave(group, 1).transpose(0, 1).to(work)
        vs = v[start:end].repeat_interleave(group, 1).transpose(0, 1).to(work)
        scores = qs @ ks.transpose(1, 2) * scale
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append((torch.exp(scores - lse.unsqueeze(-1)) @ vs).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
