"""Batched target-only generation through the KV cache: the reference the speculative loop must match.

Prompts of different lengths are prefilled together, right-padded, from an empty cache. The padded
tail of a short row writes cache entries past that row's length; they are scratch (see `causal_lm.KVCache`)
and the row's first decoded token overwrites them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class Loop:
    """Whether a growing output has just repeated an earlier n-gram of itself."""

    def __init__(self, n: int):
        self.n, self.seen = n, set()

    def repeats(self, out: list[int]) -> bool:
        if len(out) < self.n:
            return False
        gram = tuple(out[-self.n :])
        if gram in self.seen:
            return True
        self.seen.add(gram)
        return False


class States:
    """The target's states of every token a `generate` call feeds it (pass one as its `states`):
    per row, the prompt's (prefill) and each decoded token's, i.e. all but the last new token, which
    is never fed. These are the states precompute would compute for that text, had it been
    tokenized the same way; generation computes them anyway, so keeping them costs a copy.

    After the call `cache` still holds every row, committed through the tokens fed, with `room`
    spare slots, and `feed` runs more tokens after them (a chat template's end of turn)."""

    def __init__(self, capture: tuple[int, ...] = (), room: int = 0):
        self.capture, self.room = capture, room
        self.prefill: torch.Tensor | None = None  # [B, S, H'] right-padded
        self.steps: list[torch.Tensor] = []  # [B, H'] per decode step
        self.cache: Cache | None = None

    def start(self, model: TargetModel, cache: Cache, prefill: torch.Tensor) -> None:
        self.model, self.cache, self.prefill = model, cache, prefill
        self.prompt_lengths = cache.lengths.tolist()

    def row(self, b: int, fed: int) -> torch.Tensor:
        """Row b's states [fed, H'] (H' = H widened by `capture`): its prompt's, then its decoded tokens'."""
        prompt = self.prompt_lengths[b]
        decoded = [step[b] for step in self.steps[: fed - prompt]]
        return torch.cat([self.prefill[b, :prompt], *(x[None] for x in decoded)])

    @torch.inference_mode()
    def feed(self, tails: list[list[int]]) -> list[torch.Tensor]:
        """The states [len(tails[b]), H'] of `tails[b]` placed after row b's committed tokens, as one
        right-padded forward (the padding's states and cache entries are scratch). Commits nothing."""
        width = max(map(len, tails))
        if width == 0:
            return [self.prefill.new_empty(0, self.prefill.shape[-1]) for _ in tails]
        room = self.cache.max_len - int(self.cache.lengths.max())
        if width > room:
            raise ValueError(f"{width} tokens to feed after the rows, room for {room}: ask for more room")
        ids, _ = right_pad(tails, self.cache.lengths.device)
        hidden = self.model.forward_cached(ids, self.cache, capture=self.capture)
        return [hidden[b, : len(t)] for b, t in enumerate(tails)]


@torch.inference_mode()
def generate(
    model: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    states: States | None = None,
    stop_repeat: int = 0,
    compact: bool = False,
) -> list[list[int]]:
    """New tokens per prompt (up to and including the first EOS), greedy at temperature 0.
    A `generator` must be on the model's device. `states` keeps the target's states (see `States`).
    `stop_repeat` n > 0: a row also stops when its last n new tokens repeat an earlier n-gram of its
    output (a loop: small targets answer long prompts by repeating themselves), with that n-gram
    kept once; the row stops where it stands, so `states` stay aligned.
    `compact`: once half the batch has finished, the finished rows leave it (a smaller cache and
    step). Without it every row steps until the last finishes; with a long `max_new_tokens` most of
    those steps are spent on finished rows. Not with `states`, whose cache must keep every row; and
    a row's numbers may differ in the last bits at another batch size, so the speculative loop's
    reference is the call without it."""
    if states and compact:
        raise ValueError("generate: compact drops rows from the cache that states keeps")
    eos = set(eos_ids)
    loops = [Loop(stop_repeat) for _ in prompts] if stop_repeat else None
    capture, room = (states.capture, states.room) if states else ((), 0)
    cache, hidden = prefill(model, prompts, max(len(p) for p in prompts) + max_new_tokens + room, capture)
    token = sample(last_logits(model, hidden, cache.lengths), temperature, generator)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = [True] * len(prompts)
    rows = list(range(len(prompts)))  # the prompt each cache row answers
    # a CUDA graph on GPU, the eager step elsewhere
    step = Step(DecodeStep(model, cache, capture=capture), cache, temperature, generator, states)
    if states:
        states.start(model, cache, hidden)
    if not (loops or compact):  # stops the device can decide itself: the host runs a step behind
        return decode_ahead(step, token, outputs, eos, max_new_tokens)
    while True:
        for b, t in zip(rows, token.tolist()):
            if active[b]:
                active[b] = not append_until_done(outputs[b], [t], eos, max_new_tokens)
                if active[b] and loops:
                    active[b] = not loops[b].repeats(outputs[b])
        live = [j for j, b in enumerate(rows) if active[b]]
        if not live:
            return outputs
        if compact and len(live) <= len(rows) // 2:
            index = torch.tensor(live, device=token.device)
            del step  # its captured graph and buffers, before the next one is captured
            cache, token, rows = cache.rows(index), token[index], [rows[j] for j in live]
            step = Step(DecodeStep(model, cache, capture=capture), cache, temperature, generator, states)
        # Every row steps (one batched forward); only active rows commit, so a finished row keeps
        # rewriting the same scratch slot and never grows past the cache.
        token = step(token, torch.tensor([active[b] for b in rows], device=token.device))


@dataclass
class Step:
    """One decode step of `generate`: the graphed forward, the cache it commits to, how it samples,
    and the states it keeps."""

    decode: DecodeStep
    cache: Cache
    temperature: float
    generator: torch.Generator | None
    states: States | None

    def __call__(self, token: torch.Tensor, commit: torch.Tensor) -> torch.Tensor:
        """Feed token [B], commit it in the rows `commit` [B] marks, return the next token [B]."""
        logits = self.decode(token[:, None])
        if self.states:  # a copy: a graph's buffer is refilled next step
            self.states.steps.append(self.decode.hidden[:, -1].clone())
        self.cache.lengths += commit
        return sample(logits, self.temperature, self.generator)


def decode_ahead(
    step: Step, token: torch.Tensor, outputs: list[list[int]], eos: set[int], max_new_tokens: int
) -> list[list[int]]:
    """`generate`'s loop with the host one step behind the GPU: the device applies the stopping rule
    itself (a row stops at an EOS or at `max_new_tokens`, and commits no token after), so step n + 1
    is queued before the host reads step n's tokens. The host's work between steps (reading the
    tokens, the bookkeeping, launching the graph) then overlaps the step instead of leaving the GPU
    idle: 0.64 ms a step at batch 1 on an H100 at the Llama-3.1-8B shape (`bench_decode`,
    2026-12-05). The outputs are those of the synchronous loop; where the last rows stop at an EOS
    before the limit, the step queued meanwhile is wasted (it commits nothing)."""
    stops = torch.tensor(sorted(eos), dtype=token.dtype, device=token.device)
    produced = torch.zeros_like(token)  # new tokens per row so far, counted on the device
    active = torch.ones_like(token, dtype=torch.bool)
    live = [True] * len(outputs)
    for new_tokens in itertools.count(1):
        produced += active
        active &= ~(torch.isin(token, stops) | (produced >= max_new_tokens))
        fed, ready = to_host(token)  # queued before the step, so reading it waits for this token only
        if new_tokens < max_new_tokens:  # at the limit every row stops at this token: nothing to feed
            token = step(token, active)
        ready()
        for b, t in enumerate(fed.tolist()):
            if live[b]:
                live[b] = not append_until_done(outputs[b], [t], eos, max_new_tokens)
        if not any(live):
            return outputs


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A host copy of a device tensor queued without waiting, and what waits for that copy alone."""
    if t.device.type != "cuda":
        return t.cpu(), lambda: None
    host = t.to("cpu", non_blocking=True)  # pinned memory
    copied = torch.cuda.Event()
    copied.record()
    return host, copied.synchronize
