"""Batched target-only generation through the KV cache: the reference the speculative loop must match.

Prompts of different lengths are prefilled together, right-padded, from an empty cache. The padded
tail of a short row writes cache entries past that row's length; they are scratch (see `causal_lm.KVCache`)
and the row's first decoded token overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_ref.decode_graph import DecodeStep
from inference_ref.target import Cache, TargetModel


def right_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] (padded with 0; the padding's outputs are never read) and lengths [B]."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
    return ids, torch.tensor([len(p) for p in prompts], device=device)


def at_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] → x[b, positions[b]] for each row: [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), positions]


def last_logits(model: TargetModel, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, V] at each row's last real token of a right-padded hidden [B, S, H]."""
    return model.logits(at_positions(hidden, lengths - 1))


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling distribution at `temperature` > 0, in fp32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (need not be normalized)."""
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1])


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [..., V]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(probabilities(logits, temperature), generator)


def prefill(
    model: TargetModel, prompts: list[list[int]], max_len: int, capture: tuple[int, ...] = ()
) -> tuple[Cache, torch.Tensor]:
    """Run all prompts as one right-padded forward from an empty cache and commit each row's prompt.

    Returns the cache and the hidden states [B, S, H] (before the final norm; widened by `capture`,
    see `causal_lm.widened`)."""
    device = model.embed_tokens.weight.device
    ids, lengths = right_pad(prompts, device)
    cache = model.new_cache(len(prompts), max_len)
    hidden = model.forward_cached(ids, cache, capture=capture)
    cache.lengths = lengths
    return cache, hidden


def append_until_done(out: list[int], new: list[int], eos: set[int], max_new_tokens: int) -> bool:
    """Append `new` to a row's output, stopping at (and including) the first EOS or the token limit.

    Returns whether the row is now finished."""
    for token in new:
        out.append(token)
        if token in eos or len(out) >= max_new_tokens:
            return True
    return False


@torch.inference_mode()
def generate(
    model: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New tokens per prompt (up to and including the first EOS), greedy at temperature 0.
    A `generator` must be on the model's device."""
    eos = set(eos_ids)
    cache, hidden = prefill(model, prompts, max(len(p) for p in prompts) + max_new_tokens)
    token = sample(last_logits(model, hidden, cache.lengths), temperature, generator)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = [True] * len(prompts)
    decode = DecodeStep(model, cache)  # a CUDA graph on GPU, the eager step elsewhere
    while True:
        for b, t in enumerate(token.tolist()):
            if active[b]:
                active[b] = not append_until_done(outputs[b], [t], eos, max_new_tokens)
        if not any(active):
            return outputs
        # Every row steps (one batched forward); only active rows commit, so a finished row keeps
        # rewriting the same scratch slot and never grows past the cache.
        logits = decode(token[:, None])
        cache.lengths += torch.tensor(active, device=token.device)
        token = sample(logits, temperature, generator)
