"""Draft losses, computed in token chunks so peak memory does not grow with tokens × vocab.

Per supervised position: w_p · CE(softmax(L_target), draft logits) + w_h · SmoothL1(z, final_norm(h_next)),
with L_target = lm_head(final_norm(h_next)) recomputed from the stored state. Each chunk's
logits are built inside a checkpoint and rebuilt in backward, so only one chunk's
[chunk, vocab] tensors are alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class LossWeights:
    w_p: float = 1.0
    """Soft cross-entropy to the target's next-token distribution."""
    w_h: float = 0.1
    """SmoothL1 between the head's output state and the target's normalized next state."""


@dataclass
class LossSums:
    """Sums over supervised positions (divide by `count` for means)."""

    loss: torch.Tensor
    ce: torch.Tensor
    smooth_l1: torch.Tensor
    top1: torch.Tensor
    count: int


def _chunk_sums(z, target_state, lm_head, w_p: float, w_h: float):
    """One chunk: (weighted loss sum, CE sum, SmoothL1 sum, top-1 matches) over its rows."""
    # Logits in the lm_head's dtype (bf16 on GPU), softmax in fp32.
    draft_logits = F.linear(z.to(lm_head.dtype), lm_head).float()
    with torch.no_grad():
        target_logits = F.linear(target_state.to(lm_head.dtype), lm_head).float()
        p = target_logits.softmax(-1)
        top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).sum()
    ce = -(p * draft_logits.log_softmax(-1)).sum()
    sl1 = F.smooth_l1_loss(z.float(), target_state.float(), reduction="none").mean(-1).sum()
    return w_p * ce + w_h * sl1, ce.detach(), sl1.detach(), top1


def draft_loss(
    z: torch.Tensor, target_state: torch.Tensor, lm_head: torch.Tensor, weights: LossWeights, chunk: int
) -> LossSums:
    """z [N, H] head output states at supervised positions; target_state [N, H] = final_norm(h_{i+1})."""
    totals = [z.new_zeros((), dtype=torch.float32) for _ in range(4)]
    for start in range(0, z.shape[0], chunk):
        zc, tc = z[start : start + chunk], target_state[start : start + chunk]
        sums = checkpoint(_chunk_sums, zc, tc, lm_head, weights.w_p, weights.w_h, use_reentrant=False)
        totals = [t + s for t, s in zip(totals, sums)]
    return LossSums(*totals, count=z.shape[0])


def reference_loss(z, target_state, lm_head, weights: LossWeights) -> LossSums:
    """Unchunked, no recomputation: the definition the chunked loss is tested against."""
    return LossSums(*_chunk_sums(z, target_state, lm_head, weights.w_p, weights.w_h), count=z.shape[0])


class DraftObjective(torch.nn.Module):
    """The head plus its training loss in one forward, so that data-parallel wrappers (DDP,
    DeepSpeed ZeRO-3) see every parameter use inside the forward they hook."""

    def __init__(self, head, weights: LossWeights, chunk_logits: int, decay: float):
        super().__init__()
        self.head, self.weights, self.decay = head, weights, decay
        # Rows per chunk from a logits budget: peak memory stays flat in tokens and in vocabulary.
        self.chunk = max(1, chunk_logits // head.cfg.target.vocab_size)

    def forward(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over supervised positions (chained step j weighted decay^j) and per-step metrics."""
        head, steps = self.head, batch.token_ids.shape[0]
        ys = head(batch.hidden, batch.token_ids, batch.positions, batch.segments, steps)
        total = ys.new_zeros((), dtype=torch.float32)
        metrics = {}
        for j in range(steps):
            rows = batch.valid[j]
            z = head.output_state(ys[j][rows])
            target = head.final_norm(batch.target_hidden[batch.target_index[j][rows]])
            sums = draft_loss(z, target, head.lm_head_weight, self.weights, self.chunk)
            n = max(sums.count, 1)
            total = total + self.decay**j * sums.loss / n
            prefix = "" if j == 0 else f"step{j + 1}/"
            metrics[prefix + "ce"] = sums.ce / n
            metrics[prefix + "smooth_l1"] = sums.smooth_l1 / n
            metrics[prefix + "top1"] = sums.top1 / n
            metrics[prefix + "count"] = torch.tensor(float(sums.count), device=total.device)
        return total, metrics
