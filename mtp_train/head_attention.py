"""Attention of the draft head over packed samples, for one or several chained steps.

Step 0 (the target-fed pass) is causal attention inside each packed sample. A chained step j ≥ 1
at position i sees the step-0 keys ≤ i and its own chain's keys of steps 1 … j at the same i:
a diagonal per step. So the causal part is computed once per step with its log-sum-exp, the
diagonal scores elementwise, and the two merged by their log-sum-exps, never building a
T × T × k mask.

On CUDA the causal part is varlen FlashAttention. The kernel returns the log-sum-exp but no
gradient for it, and the merge needs one: `_AttentionWithLse` supplies it from two more kernel
calls (see its backward). Elsewhere an exact per-sample computation serves, differentiated by autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference_ref.attention import packed_causal_attention, varlen_with_lse


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
        return flash_or_sdpa(q, k0, v0, seg)
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


def flash_or_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Causal attention inside each sample, differentiable, in q's dtype."""
    if q.is_cuda and q.dtype == torch.float32 and torch.is_grad_enabled():
        # fp32 training without DeepSpeed's bf16: FlashAttention takes 16-bit inputs only, and
        # its fallback (one SDPA call per sample) makes a small head's step CPU-bound. Run it
        # in bf16 as autocast would; the result and the gradients return to fp32. Not without
        # gradients: validation's fp32 trainer path stays fp32.
        half = [t.bfloat16() for t in (q, k, v)]
        return packed_causal_attention(*half, seg.cu_seqlens, seg.max_len).float()
    return packed_causal_attention(q, k, v, seg.cu_seqlens, seg.max_len)


def causal_attention_with_lse(q, k, v, seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention inside each sample and its log-sum-exp [T, Hq] (fp32), both differentiable."""
    global _flash_lse_usable
    fp32_inference = q.dtype == torch.float32 and not torch.is_grad_enabled()
    square = q.shape[0] == q.shape[1]  # varlen_with_lse cannot tell the lse layout (tiny batches)
    if q.is_cuda and _flash_lse_usable and not fp32_inference and not square:
        try:
            return _AttentionWithLse.apply(q, k, v, seg, FLASH)
        except _NoFlashLse:  # this torch's kernel cannot: the exact path, for the whole run
            _flash_lse_usable = False
    return exact_attention_with_lse(q, k, v, seg)


class _NoFlashLse(RuntimeError):
    pass


_flash_lse_usable = True


@dataclass(frozen=True)
class Kernels:
    """The two primitives `_AttentionWithLse` is built on."""

    attention: Callable  # (q, k, v, seg) → out, differentiable
    with_lse: Callable  # (q, k, v, seg) → (out, lse fp32), forward only


class _AttentionWithLse(torch.autograd.Function):
    """(out, lse) of causal attention, with the gradient of lse that the kernel lacks.

    lse_i = log Σ_j exp(s · q_i·k_j) (s the softmax scale, p_ij its softmax) has
    ∂lse_i/∂q_i = s Σ_j p_ij k_j — attention with the keys as values — and
    ∂lse_i/∂k_j = s Σ_i p_ij q_i — what attention's backward gives as "dV" for upstream gradient q_i.
    So with g = ∂L/∂lse: dq += s · g · attn(q, k, k), dk += s · dV of attn(q, k, 0) for upstream g · q.
    """

    @staticmethod
    def forward(ctx, q, k, v, seg: Segments, kernels: Kernels):
        out, lse = kernels.with_lse(q, k, v, seg)
        ctx.save_for_backward(q, k, v)
        ctx.seg, ctx.kernels = seg, kernels
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v = ctx.saved_tensors
        seg, kernels = ctx.seg, ctx.kernels
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            if grad_out is None:
                grad_out = torch.zeros_like(q)
            dq, dk, dv = torch.autograd.grad(kernels.attention(q_, k_, v_, seg), (q_, k_, v_), grad_out)
            if grad_lse is not None:
                scale = q.shape[-1] ** -0.5
                work = torch.promote_types(q.dtype, torch.float32)
                g = grad_lse.unsqueeze(-1).to(work)
                zero = torch.zeros_like(k).requires_grad_()
                upstream = (g * q.to(work)).to(q.dtype)
                (dz,) = torch.autograd.grad(kernels.attention(q, k, zero, seg), (zero,), upstream)
                with torch.no_grad():
                    keys_as_values = kernels.attention(q, k, k, seg)
                dq = dq + (scale * g * keys_as_values.to(work)).to(dq.dtype)
                dk = dk + scale * dz
        return dq, dk, dv, None, None


def _flash_with_lse(q, k, v, seg: Segments):
    half = [t.to(torch.bfloat16) if t.dtype == torch.float32 else t for t in (q, k, v)]
    result = varlen_with_lse(*half, seg.cu_seqlens, seg.max_len)
    if result is None:
        raise _NoFlashLse
    return result[0].to(q.dtype), result[1]


FLASH = Kernels(attention=flash_or_sdpa, with_lse=_flash_with_lse)


@torch.autocast("cuda", enabled=False)  # fp32 as written, also inside bf16 training (train.precision)
@torch.autocast("cpu", enabled=False)
def exact_attention_with_lse(q, k, v, seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
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
