"""Draft losses, computed in token chunks so peak memory does not grow with tokens × vocab.

Per supervised position: w_p · CE(softmax(L_target), draft logits) + w_h · SmoothL1(z, final_norm(h_next)),
with L_target = lm_head(final_norm(h_next)) recomputed from the stored state.

The loss is one autograd function that walks the rows chunk by chunk and, while a chunk's
[rows, vocab] logits are alive, also forms that chunk's gradient with respect to z:
d(w_p·CE)/d logits = w_p · (softmax(draft) − p), then × lm_head. Backward only scales the saved
[N, H] gradient. Only one chunk's logits exist at a time, and nothing is recomputed: the
vocabulary work is exactly draft logits + target logits + one gradient matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def _chunk(zc, tc, lm_head, w_p: float, w_h: float):
    """One chunk's (CE sum, SmoothL1 sum, top-1 matches, d loss / d z)."""
    # Logits in the lm_head's dtype (bf16 on GPU), softmax in fp32 (fp64 when testing in fp64).
    work = torch.promote_types(zc.dtype, torch.float32)
    draft_logits = F.linear(zc.to(lm_head.dtype), lm_head).to(work)
    target_logits = F.linear(tc.to(lm_head.dtype), lm_head).to(work)
    p = target_logits.softmax(-1)
    log_q = draft_logits.log_softmax(-1)
    ce = -(p * log_q).sum()
    top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).sum()
    grad_logits = (log_q.exp_() - p).mul_(w_p)
    grad = F.linear(grad_logits.to(lm_head.dtype), lm_head.t()).to(work)
    diff = zc.to(work) - tc.to(work)
    sl1 = F.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="none").mean(-1).sum()
    grad += diff.clamp(-1.0, 1.0) * (w_h / diff.shape[-1])  # d/dz of mean_H SmoothL1 (β = 1)
    return ce, sl1, top1, grad


_compiled_chunk = None


def chunk_function(compiled: bool):
    """`_chunk`, or its torch.compile'd form: the matmuls stay cuBLAS', the elementwise work on the
    [rows, vocab] logits (the fp32 casts, both softmaxes, the CE product, argmax, dlogits) fuses into
    a few kernels that read the chunk once or twice instead of ~10 times (docs/benchmarks.md: that
    work was 30 % of an 8B-shape step). Rows vary only in the last chunk: one recompile, dynamic."""
    global _compiled_chunk
    if not compiled:
        return _chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk)
    return _compiled_chunk


class _ChunkedDraftLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target_state, lm_head, w_p: float, w_h: float, chunk: int, compiled: bool):
        work = torch.promote_types(z.dtype, torch.float32)
        grad = torch.empty(z.shape, dtype=work, device=z.device)
        sums = torch.zeros(3, dtype=work, device=z.device)
        one_chunk = chunk_function(compiled)
        for start in range(0, z.shape[0], chunk):
            rows = slice(start, start + chunk)
            ce, sl1, top1, grad[rows] = one_chunk(z[rows].detach(), target_state[rows], lm_head, w_p, w_h)
            sums += torch.stack([ce, sl1, top1.to(work)])
        ctx.save_for_backward(grad)
        ctx.z_dtype = z.dtype
        loss = w_p * sums[0] + w_h * sums[1]
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.z_dtype), None, None, None, None, None, None


def draft_loss(
    z: torch.Tensor,
    target_state: torch.Tensor,
    lm_head: torch.Tensor,
    weights: LossWeights,
    chunk: int,
    compiled: bool = False,
) -> LossSums:
    """z [N, H] head output states at supervised positions; target_state [N, H] = final_norm(h_{i+1});
    `compiled`: each chunk through `chunk_function(True)` (CUDA)."""
    loss, sums = _ChunkedDraftLoss.apply(
        z, target_state.detach(), lm_head.detach(), weights.w_p, weights.w_h, chunk, compiled
    )
    return LossSums(loss, sums[0], sums[1], sums[2], count=z.shape[0])


def reference_loss(z, target_state, lm_head, weights: LossWeights) -> LossSums:
    """Plain autograd over the whole batch: the definition the chunked loss is tested against."""
    work = torch.promote_types(z.dtype, torch.float32)
    draft_logits = F.linear(z.to(lm_head.dtype), lm_head).to(work)
    with torch.no_grad():
        target_logits = F.linear(target_state.to(lm_head.dtype), lm_head).to(work)
        p = target_logits.softmax(-1)
        top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).sum()
    ce = -(p * draft_logits.log_softmax(-1)).sum()
    sl1 = F.smooth_l1_loss(z.to(work), target_state.to(work), reduction="none").mean(-1).sum()
    loss = weights.w_p * ce + weights.w_h * sl1
    return LossSums(loss, ce.detach(), sl1.detach(), top1, count=z.shape[0])


class DraftObjective(torch.nn.Module):
    """The head plus its training loss in one forward, so that data-parallel wrappers (DDP,
    DeepSpeed ZeRO-3) see every parameter use inside the forward they hook."""

    def __init__(self, head, weights: LossWeights, chunk_logits: int, decay: float, compiled: bool = False):
        super().__init__()
        self.head, self.decay, self.compiled = head, decay, compiled
        # EAGLE-3 drops the feature regression: its y need not live where the target's last layer does.
        self.weights = weights if head.spec.kind.feature_loss else LossWeights(weights.w_p, 0.0)
        # Rows per chunk from a logits budget: peak memory stays flat in tokens and in vocabulary.
        self.chunk = max(1, chunk_logits // head.spec.vocab)

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
            sums = draft_loss(z, target, head.lm_head_weight, self.weights, self.chunk, self.compiled)
            n = max(sums.count, 1)
            total = total + self.decay**j * sums.loss / n
            prefix = "" if j == 0 else f"step{j + 1}/"
            metrics[prefix + "ce"] = sums.ce / n
            metrics[prefix + "smooth_l1"] = sums.smooth_l1 / n
            metrics[prefix + "top1"] = sums.top1 / n
            metrics[prefix + "count"] = torch.tensor(float(sums.count), device=total.device)
        return total, metrics
