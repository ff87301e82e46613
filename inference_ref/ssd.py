"""What an asynchronous drafter would get: speculative speculative decoding (SSD; Kumar, Dao, May,
"Speculative Speculative Decoding", arXiv 2603.03251, ICLR 2026; code: github.com/tanishqkumar/ssd
at 6ed3022). While the target verifies a chain d_1 … d_K, the draft predicts the verification's
outcome v = (k, t*) — k drafts accepted, t* the bonus token — and prepares the next chain for each
predicted outcome; when the real outcome is among them (a cache hit), drafting costs nothing.

The cache for one verify (ssd `async_spec_helpers.py`, `get_forked_recovery_tokens_from_logits`):
for every k in 0 … K, the top-F_k tokens of the draft's distribution at position k + 1 — with the
drafted d_{k+1} left out for k < K, since a rejection there means the residual max(p − q, 0) is 0
at d_{k+1} and t* cannot be it (at T = 0, t* = argmax p ≠ d_{k+1}); for k = K the draft's
distribution after d_K, where t* comes from p itself. A hit is t* among the tokens cached for the
k that happened.

Saguaro sampling (the paper's Def. 14; ssd `apply_sampler_x_rescaling`) drafts from, and verifies
against, q' ∝ C·q on the draft's top tokens (F of them plus the drafted one) and q elsewhere: the
residual max(p − q', 0) then concentrates on the cached tokens, raising the hit rate at some cost
in acceptance. Rejection sampling against q' keeps the output exactly the target's, since the same
q' is used for the ratio test and the residual.
"""

from __future__ import annotations

import torch


def cached_tokens(draft_logits: torch.Tensor, drafted: torch.Tensor, fan_out: int) -> torch.Tensor:
    """The tokens an SSD cache of fan-out `fan_out` per position holds for each outcome k.

    draft_logits [B, K+1, V]: row k is the draft's distribution for position k + 1 (the last, after
    d_K); drafted [B, K]. Returns [B, K+1, fan_out] token ids."""
    logits = draft_logits.float().clone()
    k = drafted.shape[1]
    logits[:, :k].scatter_(-1, drafted[:, :, None], float("-inf"))  # t* ≠ the rejected draft
    return logits.topk(fan_out, dim=-1).indices


def cache_hits(
    draft_logits: torch.Tensor,
    drafted: torch.Tensor,
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    fan_out: int,
) -> torch.Tensor:
    """[B] bool: whether each row's verification outcome (accepted [B] drafts, bonus [B] token) is
    in an SSD cache of `fan_out` tokens per outcome position."""
    tokens = cached_tokens(draft_logits, drafted, fan_out)
    at = tokens.gather(1, accepted.long()[:, None, None].expand(-1, 1, fan_out))[:, 0]  # [B, F]
    return (at == bonus[:, None]).any(-1)


def saguaro(q: torch.Tensor, fan_out: int, c: float) -> torch.Tensor:
    """The draft distribution q [..., V] with its top `fan_out` + 1 tokens (the cached ones and the
    drafted one) scaled by `c` and renormalized: what Saguaro sampling drafts from and verifies
    against (c = 1: q unchanged)."""
    if c == 1.0:
        return q
    top = q.topk(fan_out + 1, dim=-1).indices
    scaled = q.scatter(-1, top, q.gather(-1, top) * c)
    return scaled / scaled.sum(-1, keepdim=True)


def geometric_fan_out(budget: int, k: int, accept: float, r: float) -> list[float]:
    """The paper's fan-out per outcome position for a cache of `budget` tokens (its Thm. 12, as
    transcribed, re-derived here): with acceptance `accept` per draft and cache misses falling as
    F^(−r), F_j ∝ P(k = j)^(1/(1+r)) for the capped geometric P(k = j) = a^j (1 − a), P(K) = a^K."""
    weights = [(accept**j * (1 - accept)) ** (1 / (1 + r)) for j in range(k)] + [(accept**k) ** (1 / (1 + r))]
    total = sum(weights)
    return [budget * w / total for w in weights]
