"""The tests' shared tiny configs (the registry's debug shapes, varied where a test needs it) and
shared assertions."""

from __future__ import annotations

import math

import torch

from inference_ref.generate import at_positions
from inference_ref.models import TARGET_KINDS
from inference_ref.models.deepseek_v2 import DeepseekV2Config
from inference_ref.models.llama import LlamaConfig
from mtp_train.cli import compose_recipe as recipe  # noqa: F401  (the tests compose their configs with it)


def tiny_llama(**changes) -> LlamaConfig:
    """The registry's tiny Llama shape (vocab 256 unless changed), with `changes`."""
    return LlamaConfig(**{"vocab_size": 256, **TARGET_KINDS["llama"].tiny, **changes})


def tiny_deepseek(**changes) -> DeepseekV2Config:
    """The registry's tiny DeepSeek-V2 shape (vocab 256 unless changed), with `changes`."""
    return DeepseekV2Config(**{"vocab_size": 256, **TARGET_KINDS["deepseek_v2"].tiny, **changes})


def frozen_of(target) -> dict[str, torch.Tensor]:
    """The target tensors a training head is built with (as `frozen_target_tensors` reads them)."""
    return {
        "model.embed_tokens.weight": target.embed_tokens.weight.detach().clone(),
        "model.norm.weight": target.norm.weight.detach().clone(),
        "lm_head.weight": target.lm_head.weight.detach().clone(),
    }


def randomized(head, seed: int | None = None, scale: float = 0.1):
    """Every trainable tensor random (norms around 1, the rest `scale` · N(0, 1)), so that each part
    of the math shows in the output; reseeded first when `seed` is given."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return head


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference, relative to the reference's largest magnitude."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def assert_chains_match_training(draft, hidden, tokens, ref_y, ref_logits, tolerance: float = 1e-4) -> None:
    """Chained drafting from several bases i at once (one batch row per base, each holding the
    whole sequence, committed through its base: the rest is scratch) equals the training head's
    unrolled steps `ref_y` [steps, n, H] / `ref_logits`, states and logits, at every step.
    hidden [n, H'] and tokens [steps, n] are the training head's inputs (row j: the token fed at
    depth j + 1)."""
    steps, n = tokens.shape
    bases = torch.tensor([0, 3, 9, n - 1])
    cache = draft.new_cache(len(bases), n + steps)
    y = draft.prefill(hidden.expand(len(bases), n, -1), tokens[0].expand(len(bases), n), cache)
    y = at_positions(y, bases)
    cache.lengths = bases + 1
    for step in range(1, steps):
        y = draft.chain(y, tokens[step, bases], cache, step)
        assert rel_err(y, ref_y[step, bases]) <= tolerance
        assert rel_err(draft.logits(y), ref_logits[step, bases]) <= tolerance


def assert_tau_consistent(run: dict, k: int) -> None:
    """τ of a speculative report (`run`: one chain length's figures) against its acceptance rates:
    every verify emits 1 + the accepted tokens, and P(token j accepted) is the product of the
    conditional rates up to j, so τ = 1 + Σ_j Π_{i≤j} accept_rate[i] exactly. Also 1 ≤ τ ≤ k + 1."""
    rates = [0.0 if math.isnan(r) else r for r in run["accept_rate"]]
    assert len(rates) == k
    expected, reach = 1.0, 1.0
    for r in rates:
        reach *= r
        expected += reach
    assert math.isclose(run["mean_accepted_len"], expected, rel_tol=1e-9), (run["mean_accepted_len"], rates)
    assert 1.0 <= run["mean_accepted_len"] <= k + 1


def assert_serves_as_trained(report: dict, k: int) -> None:
    """A validation report of an fp32 CPU run: the greedy chain of k gives the target's own output,
    its τ matches its acceptance rates, and the training module and the serving draft compute the
    same teacher-forced CE."""
    greedy = report["speculative"]["greedy"][f"k={k}"]
    assert greedy["identical_to_target_greedy"]
    assert_tau_consistent(greedy, k=k)
    tf = report["teacher_forced"]
    assert tf["parity_gap"]["ce"] < 1e-3 * max(1.0, tf["trainer"]["ce"])


def supervised_counts(store, vocab_size: int) -> torch.Tensor:
    """How often each target id is supervised in a store, counted from its samples one by one (not
    with `Store.most_frequent_tokens`, which training calls and the tests check)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(store)):
        ids, mask, _ = store.sample(i)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts
