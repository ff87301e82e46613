"""SSD outcome prediction (`inference_ref.ssd`): the cache's tokens per outcome, hits, Saguaro's
draft distribution (its definition, exactness of sampling against it in the loop, and why it raises hits), the
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


def test_saguaro_scales_the_drafts_top_tokens_by_c_and_renormalizes():
    """q' is q with its top F + 1 tokens times c, over its new sum, counted here token by token (the
    exactness of sampling against it is the loop's chi-square test below)."""
    g = torch.Generator().manual_seed(0)
    q = (3 * torch.rand(2, 50, generator=g)).softmax(-1)
    assert saguaro(q, 4, 1.0) is q
    for c in (0.5, 0.1, 0.0):
        qs = saguaro(q, 4, c)
        for row in range(2):
            top = set(sorted(range(50), key=lambda t: -q[row, t].item())[:5])
            weights = [q[row, t].item() * (c if t in top else 1.0) for t in range(50)]
            expected = torch.tensor([w / sum(weights) for w in weights])
            torch.testing.assert_close(qs[row], expected)
            assert (qs[row] >= 0).all() and torch.isclose(qs[row].sum(), torch.tensor(1.0))


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


# ------------------------------------------------------------------ in the loop (`speculative_generate`)


def test_ssd_bookkeeping_changes_nothing_and_a_whole_vocabulary_cache_always_hits(tmp_path):
    from test_speculative import bigram_head, random_prompts, serve, small_target

    from inference_ref.speculative import SSD, Chain, speculative_generate

    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1, 6, 30))
    vocab = target.cfg.vocab_size
    for k in (1, 3):
        plain = speculative_generate(target, draft, prompts, 40, [5], Chain(k))
        scored = speculative_generate(target, draft, prompts, 40, [5], Chain(k), ssd=SSD((1, 2, 8, vocab)))
        assert scored.tokens == plain.tokens
        assert (scored.stats.tried, scored.stats.accepted) == (plain.stats.tried, plain.stats.accepted)
        rate = scored.stats.hit_rate
        # every outcome's token is in a cache of the whole vocabulary (the rejected draft aside,
        # which greedy t* never is); smaller caches hit less, and a fair draft's top-1 often
        assert rate[vocab] == 1.0 and rate[1] <= rate[2] <= rate[8] <= 1.0 and rate[1] > 0.2, rate


def test_saguaro_sampling_keeps_the_target_distribution_and_raises_hits(tmp_path):
    from test_speculative import bigram_head, chi_square_pvalue, exact_joint, serve, small_target

    from inference_ref.speculative import SSD, Chain, speculative_generate

    target = small_target()
    draft = serve(bigram_head(target, "eagle1"), target, tmp_path)
    prompt, runs = [3, 14, 15, 9], 4000

    def sampled(factor: float):
        g = torch.Generator().manual_seed(0)
        ssd = SSD((1, 4), saguaro_factor=factor, saguaro_fan_out=4)
        return speculative_generate(target, draft, [prompt] * runs, 3, [], Chain(2), 1.0, g, ssd=ssd)

    plain, reshaped = sampled(1.0), sampled(0.2)
    assert chi_square_pvalue(reshaped.tokens, exact_joint(target, prompt, 1.0)) > 1e-3
    # the residual max(p − q', 0) sits on the down-weighted top tokens: rejections land in the cache
    assert reshaped.stats.hit_rate[1] > plain.stats.hit_rate[1] + 0.02, (
        plain.stats.hit_rate,
        reshaped.stats.hit_rate,
    )
