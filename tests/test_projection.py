"""The projected speed-up model (`mtp_train.projection`) on made-up costs, where every figure can be
worked out by hand."""

from __future__ import annotations

import math

import pytest

from mtp_train.projection import check, project, speedup, tau, verify_ms

COSTS = {  # a verify costs 10 ms for one token, +1 ms per extra token; a draft step 0.5 ms; 20 layers
    "shape": "made_up",
    "layers": 20,
    "verify_ms": {"4": {str(n): 10.0 + (n - 1) for n in range(1, 7)}},
    "draft_step_ms": {"4": 0.5},
}


def test_tau_multiplies_the_conditional_rates():
    rates = [0.5, 0.5, 0.5]
    assert tau(rates, 1) == 1.5 and tau(rates, 3) == 1 + 0.5 + 0.25 + 0.125
    assert tau([0.0, float("nan")], 2) == 1.0  # a position never tried adds nothing


def test_speedup_is_tokens_per_step_against_the_step_cost():
    # k = 2: τ = 1.75; step = verify of 3 tokens (12 ms) + 2 draft steps (1 ms); decoding: 10 ms a token
    assert speedup([0.5, 0.5], 2, COSTS, "4") == pytest.approx(1.75 * 10 / 13)


def test_project_names_the_best_chain_per_batch():
    report = {"speculative": {"greedy": {"k=4": {"accept_rate": [0.9, 0.8, 0.2, 0.1]}}}}
    figures = project(report, COSTS)
    row = figures["speedup"]["4"]
    assert set(row) == {"k=1", "k=2", "k=3", "k=4"}
    best = max(row, key=row.get)
    assert figures["best_k"]["4"].startswith(best)
    assert best == "k=2"  # the third draft is accepted 20% of the time: not worth its cost here


def test_check_compares_with_the_report_own_wall_clock():
    run = {"accept_rate": [0.5, 0.5], "cuda_graph": True, "speedup_vs_target_only": 1.0}
    report = {"batch_size": 4, "speculative": {"greedy": {"k=2": run}}}
    out = check(report, COSTS)["k=2"]
    assert math.isclose(out["projected"], 1.75 * 10 / 13) and math.isclose(out["error"], 1.75 * 10 / 13 - 1)
    assert check({**report, "batch_size": 64}, COSTS) is None  # no costs at that batch size


def test_trees_are_costed_by_their_verify_tokens_and_depth():
    costs = {  # measured at 1, 2, 4 and 8 tokens only: 5 is interpolated, 9 extrapolated
        "shape": "made_up",
        "verify_ms": {"4": {"1": 10.0, "2": 11.0, "4": 13.0, "8": 21.0}},
        "draft_step_ms": {"4": 0.5},
    }
    assert verify_ms(costs, "4", 4) == 13.0 and verify_ms(costs, "4", 5) == 15.0
    assert verify_ms(costs, "4", 9) == 23.0
    tree = {"draft": "tree", "depth": 3, "nodes": 8, "verify_tokens": 9, "mean_accepted_len": 3.5}
    chain = {"accept_rate": [0.5, 0.5, 0.5]}
    report = {"speculative": {"greedy": {"k=3": chain, "tree n=8": tree}}}
    figures = project(report, costs)
    # τ 3.5 for a verify of 9 tokens (23 ms) and 3 draft steps (1.5 ms), against 10 ms a token
    assert figures["speedup"]["4"]["tree n=8"] == pytest.approx(round(3.5 * 10 / 24.5, 3))
    # the chains measured (k = 1: 1.5 × 10 / 11.5; k = 3: 1.875 × 10 / 14.5) stay under 1.31
    assert figures["best"]["4"].startswith("tree n=8")
    assert figures["best_k"]["4"].startswith("k=")


def test_a_block_drafter_pays_its_layers_once_per_verify():
    """A DFlash head of 2 layers drafts any k in one forward of 2 layers: k = 4's step is a verify of
    5 tokens (14 ms) + 2 layer passes (1 ms), not + 4 draft steps (2 ms)."""
    rates = [0.9, 0.8, 0.2, 0.1]
    block = {"accept_rate": rates, "draft_layer_passes": 2, "block_drafter": True}
    figures = project({"speculative": {"greedy": {"k=4": block}}}, COSTS)
    assert figures["speedup"]["4"]["k=4"] == pytest.approx(tau(rates, 4) * 10 / 15, abs=1e-3)
    assert figures["speedup"]["4"]["k=1"] == pytest.approx(tau(rates, 1) * 10 / 12, abs=1e-3)
    chained = {"accept_rate": rates, "draft_layer_passes": 4, "block_drafter": False}
    assert project({"speculative": {"greedy": {"k=4": chained}}}, COSTS)["speedup"]["4"]["k=1"] == (
        pytest.approx(tau(rates, 1) * 10 / 11.5, abs=1e-3)
    )


def test_a_stacked_head_pays_its_extra_layers_at_the_targets_layer_cost():
    """Two stacked layers (8 passes for k = 4): each draft token is a draft step (0.5 ms: fc, one
    layer, the lm_head) plus one layer of the target's shape, (10 − 0.5) / (20 − 1) = 0.5 ms; a
    tree's depth pays the same; `check` costs it alike; costs without `layers` are refused by name."""
    rates = [0.9, 0.8, 0.2, 0.1]
    stacked = {"accept_rate": rates, "draft_layer_passes": 8, "block_drafter": False}
    tree = {"draft": "tree", "verify_tokens": 9, "depth": 3, "mean_accepted_len": 3.5}
    figures = project({"speculative": {"greedy": {"k=4": stacked, "tree n=8": tree}}}, COSTS)
    assert figures["speedup"]["4"]["k=1"] == pytest.approx(tau(rates, 1) * 10 / (11 + 1.0), abs=1e-3)
    assert figures["speedup"]["4"]["k=4"] == pytest.approx(tau(rates, 4) * 10 / (14 + 4.0), abs=1e-3)
    assert figures["speedup"]["4"]["tree n=8"] == pytest.approx(3.5 * 10 / (18 + 3.0), abs=1e-3)
    measured = {**stacked, "cuda_graph": True, "speedup_vs_target_only": 1.0}
    checked = check({"batch_size": 4, "speculative": {"greedy": {"k=4": measured}}}, COSTS)
    assert checked["k=4"]["projected"] == pytest.approx(tau(rates, 4) * 10 / 18)
    with pytest.raises(ValueError, match="no 'layers'"):
        project(
            {"speculative": {"greedy": {"k=4": stacked}}}, {k: v for k, v in COSTS.items() if k != "layers"}
        )


def test_a_draft_vocabulary_is_costed_by_its_own_draft_step_where_measured():
    """An eagle3 head of 32,000 draft tokens: its draft step is the costs' for that vocabulary
    (0.2 ms instead of 0.5); a vocabulary the costs did not measure, the whole one's."""
    costs = {**COSTS, "draft_step_ms_by_vocab": {"32000": {"4": 0.2}}}
    run = {"accept_rate": [0.5, 0.5], "draft_vocab_size": 32000}
    figures = project({"speculative": {"greedy": {"k=2": run}}}, costs)
    assert figures["speedup"]["4"]["k=2"] == pytest.approx(round(1.75 * 10 / 12.4, 3))
    assert figures["draft_step_ms"] == {"4": 0.2}
    whole = project({"speculative": {"greedy": {"k=2": {**run, "draft_vocab_size": 49152}}}}, costs)
    assert whole["speedup"]["4"]["k=2"] == pytest.approx(round(1.75 * 10 / 13, 3))
    measured = {**run, "cuda_graph": True, "speedup_vs_target_only": 1.0}
    assert check({"batch_size": 4, "speculative": {"greedy": {"k=2": measured}}}, costs)["k=2"][
        "projected"
    ] == pytest.approx(1.75 * 10 / 12.4)


def test_the_cost_benchmark_times_the_real_drafts_step():
    """`bench_verify_cost`'s draft step is a random head of the kind, loaded as serving loads it,
    drafting a token (on a CPU the step runs; the CUDA graph that times it needs a GPU): an eagle3
    head on a vocabulary of 100k or more drafts from its 32,000-row draft vocabulary (the first ids)."""
    import torch

    from benchmarks.bench_verify_cost import draft_steps, eagle3_draft_vocab
    from benchmarks.random_draft import head_spec, random_draft
    from inference_ref.models import TARGET_KINDS

    registry = TARGET_KINDS["llama"]
    cfg = registry.config(**{**registry.tiny, "vocab_size": 100_000, "num_hidden_layers": 8})
    target = registry.random(cfg, "cpu", torch.float32, 0)
    assert eagle3_draft_vocab(cfg) == 32_000
    deepseek = TARGET_KINDS["deepseek_v2"]
    assert eagle3_draft_vocab(deepseek.config(**{**deepseek.tiny, "vocab_size": 200_000})) == 0
    drafted = {}
    for variant in ("rmsnorm-restored", "eagle3"):
        ((batch, step),) = draft_steps(random_draft(target, head_spec(variant, cfg)), [3], context=8)
        with torch.inference_mode():
            drafted[variant] = step()
        assert drafted[variant].shape == (batch,)
    assert (drafted["eagle3"] < 32_000).all()
