"""The head, its alignment, its attention over packed and chained steps, and the chunked loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_ref.models.llama import LlamaConfig, Rotary
from mtp_train.batching import MicroBatchPlan, align_sample, collate
from mtp_train.head_attention import Segments, head_attention
from mtp_train.heads import HeadSpec, MTPHead
from mtp_train.losses import DraftObjective, LossWeights, draft_loss, reference_loss
from tiny import tiny_llama

CFG = tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=64, head_dim=8, tie_word_embeddings=False)


def frozen(cfg: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(cfg.hidden_size, generator=g),
        "lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.2,
    }


def make_head(variant: str = "rmsnorm-restored", seed: int = 0) -> MTPHead:
    torch.manual_seed(seed)
    return MTPHead(HeadSpec(variant, CFG), frozen(CFG))


def test_five_token_alignment_by_hand():
    # t = [10, 11, 12, 13, 14]; only t3, t4 are assistant tokens.
    ids = torch.tensor([10, 11, 12, 13, 14])
    mask = torch.tensor([0, 0, 0, 1, 1])
    tokens, index, valid = align_sample(ids, mask, offset=100, steps=2)
    # Step 1: position i reads (h_i, t_{i+1}) and is trained toward the target at i+1;
    # supervised for i ≤ n-3 = 2 where t_{i+2} is an assistant token: i = 1 (t3), i = 2 (t4).
    assert tokens[0].tolist() == [11, 12, 13, 14]
    assert index[0].tolist() == [101, 102, 103, 104]
    assert valid[0].tolist() == [False, True, True, False]
    # Step 2 (chained): position i is fed t_{i+2} and trained toward the target at i+2,
    # which exists for i ≤ 1 and is supervised where t_{i+3} is: i = 0 (t3), i = 1 (t4).
    assert tokens[1].tolist()[:3] == [12, 13, 14]
    assert index[1].tolist()[:3] == [102, 103, 104]
    assert valid[1].tolist() == [True, True, False, False]


def test_collate_packs_shifted_samples():
    h1, h2 = torch.randn(5, 3), torch.randn(4, 3)
    s1 = (torch.arange(5), torch.ones(5, dtype=torch.long), h1)
    s2 = (torch.arange(4) + 50, torch.ones(4, dtype=torch.long), h2)
    batch = collate([s1, s2], steps=1)
    assert batch.segments.cu_seqlens.tolist() == [0, 4, 7]
    assert torch.equal(batch.hidden, torch.cat([h1[:4], h2[:3]]))
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch.token_ids[0].tolist() == [1, 2, 3, 4, 51, 52, 53]
    # Targets point at h_{i+1} of the same sample inside the packed target states.
    assert torch.equal(batch.target_hidden[batch.target_index[0]], torch.cat([h1[1:], h2[1:]]))
    assert batch.valid[0].tolist() == [True, True, True, False, True, True, False]


def brute_force_chain_attention(q, kv, seg: Segments):
    """Step j's query at i attends to step-0 keys ≤ i (same sample) and its own keys of steps 1 … j."""
    steps, T = len(kv), q.shape[0]
    group = q.shape[1] // kv[0][0].shape[1]
    keys = torch.cat([k for k, _ in kv]).repeat_interleave(group, 1)  # [steps*T, Hq, d]
    vals = torch.cat([v for _, v in kv]).repeat_interleave(group, 1)
    sample = torch.repeat_interleave(torch.arange(len(seg.cu_seqlens) - 1), seg.cu_seqlens.diff())
    pos = torch.arange(T)
    allowed = torch.zeros(T, steps * T, dtype=torch.bool)
    allowed[:, :T] = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    for m in range(1, steps):
        allowed[pos, m * T + pos] = True
    scores = torch.einsum("thd,shd->hts", q, keys) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vals)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_chained_attention_matches_explicit_mask(steps):
    torch.manual_seed(0)
    seg = Segments(torch.tensor([0, 5, 12, 13]), 7)
    q = torch.randn(13, 4, 8, dtype=torch.float64)
    kv = [
        (torch.randn(13, 2, 8, dtype=torch.float64), torch.randn(13, 2, 8, dtype=torch.float64))
        for _ in range(steps)
    ]
    got = head_attention(q, kv, seg)
    torch.testing.assert_close(got, brute_force_chain_attention(q, kv, seg))


@pytest.mark.parametrize("variant", ["rmsnorm-restored", "eagle1"])
def test_packing_respects_sample_boundaries(variant):
    head = make_head(variant).double()
    torch.manual_seed(1)
    lens = [6, 3, 8]
    hidden = torch.randn(sum(lens), CFG.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (2, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 6, 9, 17])
    packed = head(hidden, ids, pos, Segments(cu, 8), steps=2)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = head(hidden[a:b], ids[:, a:b], pos[a:b], Segments(torch.tensor([0, b - a]), b - a), steps=2)
        torch.testing.assert_close(packed[:, a:b], alone, msg=f"sample {s}")


def test_restored_head_structure():
    head = make_head()
    names = {n for n, _ in head.named_parameters()}
    assert {
        "enorm.weight",
        "hnorm.weight",
        "fc.weight",
        "norm.weight",
        "layer.input_layernorm.weight",
    } <= names
    assert "fc.bias" not in names
    # The final norm starts as the target's; frozen tensors are buffers, never parameters.
    torch.testing.assert_close(head.norm.weight.data, head.final_norm_weight)
    assert not any("embed" in n or "lm_head" in n for n in names)
    eagle = {n for n, _ in make_head("eagle1").named_parameters()}
    assert "fc.bias" in eagle and "enorm.weight" not in eagle and "norm.weight" not in eagle
    assert "layer.input_layernorm.weight" not in eagle


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="variant"):
        HeadSpec("medusa", CFG)


def test_chunked_loss_equals_reference_in_value_and_gradient():
    torch.manual_seed(0)
    lm_head = torch.randn(CFG.vocab_size, CFG.hidden_size, dtype=torch.float64)
    target = torch.randn(37, CFG.hidden_size, dtype=torch.float64)
    z1 = torch.randn(37, CFG.hidden_size, dtype=torch.float64, requires_grad=True)
    z2 = z1.detach().clone().requires_grad_(True)
    w = LossWeights(w_p=1.0, w_h=0.1)
    chunked = draft_loss(z1, target, lm_head, w, chunk=8)
    ref = reference_loss(z2, target, lm_head, w)
    chunked.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(chunked.loss, ref.loss)
    torch.testing.assert_close(chunked.ce, ref.ce)
    assert int(chunked.top1) == int(ref.top1)
    torch.testing.assert_close(z1.grad, z2.grad)


def test_objective_is_zero_grad_free_of_frozen_parts():
    head = make_head()
    objective = DraftObjective(head, LossWeights(), chunk_logits=16 * 97, decay=0.8)
    s = [(torch.randint(0, 97, (9,)), torch.ones(9, dtype=torch.long), torch.randn(9, 32)) for _ in range(2)]
    loss, metrics = objective(collate(s, steps=2))
    loss.backward()
    assert torch.isfinite(loss) and {"ce", "top1", "step2/ce"} <= set(metrics)
    assert all(p.grad is not None for p in head.parameters())
    assert head.lm_head_weight.grad is None and not head.lm_head_weight.requires_grad


def test_micro_batch_plan_is_deterministic_and_covers_every_sample():
    lengths = torch.randint(3, 50, (200,)).numpy()
    plan = MicroBatchPlan(lengths, budget=128, seed=3)
    again = MicroBatchPlan(lengths, budget=128, seed=3)
    seen = [i for g in range(plan.per_epoch) for i in plan.samples(g)]
    # Later epochs continue the global index, whatever their own micro-batch counts.
    later = [i for g in range(plan.per_epoch, 3 * plan.per_epoch) for i in plan.samples(g)]
    assert len(later) >= 200
    assert sorted(seen) == list(range(200))
    assert all(plan.samples(g) == again.samples(g) for g in range(plan.per_epoch + 5))
    assert all(sum(lengths[plan.samples(g)]) <= 128 for g in range(plan.per_epoch))


def test_rope_frequencies_stay_fp32_when_the_head_is_cast_to_bf16():
    """DeepSpeed's bf16 engine and validation cast the whole head: the angles must not move."""
    cfg = dataclasses.replace(CFG, rope_theta=500000.0)
    exact, cast = Rotary(cfg), Rotary(cfg).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32
    positions = torch.tensor([4000, 30000])
    for a, b in zip(exact(positions, torch.float32), cast(positions, torch.float32)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
