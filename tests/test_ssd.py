"""SSD outcome prediction (`inference_ref.ssd`): the cache's tokens per outcome, hits, Saguaro's
draft distribution (exactness of rejection sampling against it, and why it raises hits), the
geometric fan-out."""

from __future__ import annotations

import torch

from inference_ref.ssd import cache_hits, cached_tokens, geometric_fan_out, saguaro


def test_the_cache_leaves_out_the_rejected_draft_but_not_after_the_last():
    logits = torch.tensor([[[5.0, 4.0, 3.0, 0.0], [1.0, 9.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # K = 2
    drafted = torch.tensor([[0, 1]])  # each the draft's own top token
    tokens = cached_tokens(logits, drafted, 2)
    assert tokens[0, 0].tolist() == [1, 2]  # k = 0: d_1 = 0 rejected, so t* is not 0
    assert tokens[0, 1].tolist() == [2, 0]
    assert tokens[0, 2].tolist() == [3, 2]  # k = K: the draft's top tokens after d_K, none left out
    accepted, bonus = torch.tensor([1]), torch.tensor([2])
    assert cache_hits(logits, drafted, accepted, bonus, 1).item()
    assert not cache_hits(logits, drafted, torch.tensor([0]), torch.tensor([3]), 2).item()


def test_rejection_sampling_against_saguaro_keeps_the_target_distribution():
    """P(out = t) = q'(t)·min(1, p(t)/q'(t)) + (1 − α)·residual(t) = p(t) for any q', computed exactly."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(50, generator=g).softmax(0)
    q = (3 * torch.rand(50, generator=g)).softmax(0)
    for c in (1.0, 0.5, 0.1, 0.0):
        qs = saguaro(q, 4, c)
        assert torch.isclose(qs.sum(), torch.tensor(1.0))
        accepted = torch.minimum(p, qs)
        residual = (p - qs).clamp_min(0)
        out = accepted + (1 - accepted.sum()) * residual / residual.sum()
        torch.testing.assert_close(out, p)


def test_saguaro_puts_the_residual_on_the_cached_tokens():
    g = torch.Generator().manual_seed(1)
    q = (3 * torch.randn(200, generator=g)).softmax(0)
    p = (0.7 * q.log() + 0.5 * torch.randn(200, generator=g)).softmax(0)  # a target near the draft
    cached = q.topk(5).indices  # F = 4 cached tokens and the drafted one
    share = []
    for c in (1.0, 0.5, 0.1):
        residual = (p - saguaro(q, 4, c)).clamp_min(0)
        share.append(float(residual[cached].sum() / residual.sum()))
    assert share[0] < share[1] < share[2]


def test_geometric_fan_out_spends_the_budget_where_outcomes_are_likely():
    fan = geometric_fan_out(32, 4, 0.6, 0.5)
    assert abs(sum(fan) - 32) < 1e-9
    assert fan[0] > fan[1] > fan[2] > fan[3]  # fewer accepted drafts are likelier outcomes
