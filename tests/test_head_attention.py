"""The chained-step attention's log-sum-exp gradient, supplied by hand on CUDA (FlashAttention
gives none), checked on CPU against autograd through the exact per-sample computation."""

from __future__ import annotations

import torch

from mtp_train.head_attention import Kernels, Segments, _AttentionWithLse, exact_attention_with_lse

EXACT = Kernels(
    attention=lambda q, k, v, seg: exact_attention_with_lse(q, k, v, seg)[0],
    with_lse=exact_attention_with_lse,
)


def test_hand_made_lse_gradient_equals_autograd_through_the_exact_path():
    torch.manual_seed(0)
    lens = [5, 17, 1, 9]
    seg = Segments(torch.tensor([0, 5, 22, 23, 32]), max(lens))
    T = sum(lens)
    q = torch.randn(T, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)  # GQA: 3 query heads per key
    v = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)
    w_out, w_lse = torch.randn(T, 6, 8, dtype=torch.float64), torch.randn(T, 6, dtype=torch.float64)

    def loss(out, lse):  # uses both outputs, as the chained-step merge does
        return (out * w_out).sum() + (lse * w_lse).sum() + lse.exp().sum() * 1e-3

    ref_out, ref_lse = exact_attention_with_lse(q, k, v, seg)
    ref = torch.autograd.grad(loss(ref_out, ref_lse), (q, k, v))
    out, lse = _AttentionWithLse.apply(q, k, v, seg, EXACT)
    got = torch.autograd.grad(loss(out, lse), (q, k, v))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
