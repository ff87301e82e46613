"""Training batches: store samples packed into token-budget micro-batches, aligned for the draft.

For a sample t_0 … t_{n-1} with target states h_0 … h_{n-1}, draft position i = 0 … n-2 reads
(h_i, t_{i+1}). Chained step j (0-based) at i is fed t_{i+1+j} and trained toward the target at
i+1+j: distribution softmax(L_{i+1+j}) and state final_norm(h_{i+1+j}). It is supervised where
that exists (i+1+j ≤ n-2) and t_{i+2+j} is an assistant token. For j = 0 this is DESIGN.md's
"valid positions i = 0 … n-3 where t_{i+2} is supervised".

The micro-batch plan is a pure function of (store lengths, budget, seed), so the data position
of a resumed run is just its step number, and N processes split the same global sequence.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

import numpy as np
import torch

from mtp_train.head_attention import Segments


@dataclass
class DraftBatch:
    # [T] row of target_hidden fed to the head at each draft position (T = Σ (n_s - 1))
    hidden_rows: torch.Tensor
    token_ids: torch.Tensor  # [steps, T] token fed at each chained step
    positions: torch.Tensor  # [T] i within its sample
    segments: Segments
    target_hidden: torch.Tensor  # [Σ n_s, H] all stored states of the micro-batch's samples
    target_index: torch.Tensor  # [steps, T] row of target_hidden each step is trained toward
    valid: torch.Tensor  # [steps, T] bool: supervised
    tokens: int  # stored tokens in the micro-batch

    @property
    def hidden(self) -> torch.Tensor:
        """[T, H] the h_i fed to the head. Gathered where the batch is (on the GPU once moved): the
        host copies, pins and sends the states once, not a second time without each sample's last."""
        return self.target_hidden[self.hidden_rows]

    def to(self, device, dtype) -> DraftBatch:
        # Copied first, cast on the device: from pinned memory the copy is asynchronous.
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        seg = Segments(move(self.segments.cu_seqlens), self.segments.max_len)
        return DraftBatch(
            move(self.hidden_rows),
            move(self.token_ids),
            move(self.positions),
            seg,
            move(self.target_hidden).to(dtype),
            move(self.target_index),
            move(self.valid),
            self.tokens,
        )

    def pin_memory(self) -> DraftBatch:
        pinned = {
            name: getattr(self, name).pin_memory()
            for name in ("hidden_rows", "token_ids", "positions", "target_hidden", "target_index", "valid")
        }
        seg = Segments(self.segments.cu_seqlens.pin_memory(), self.segments.max_len)
        return DraftBatch(**pinned, segments=seg, tokens=self.tokens)


Key = TypeVar("Key")
Item = TypeVar("Item")


def prefetched(
    load: Callable[[Key], Item], keys: Iterable[Key], depth: int = 2, workers: int = 1
) -> Iterator[Item]:
    """load(key) for each key in order, computed up to `depth` keys ahead on `workers` background
    threads, so that building the next micro-batch (store reads, collate, pinning) overlaps the GPU
    step. Several workers help where one cannot keep up: the copies release the GIL."""
    keys = iter(keys)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = deque(pool.submit(load, key) for key in islice(keys, depth))
        while pending:
            item = pending.popleft().result()
            pending.extend(pool.submit(load, key) for key in islice(keys, 1))
            yield item


def align_sample(input_ids, loss_mask, offset: int, steps: int):
    """Per-step (token_ids, target_index, valid) [steps, n-1] for one sample whose states start at `offset`."""
    n = len(input_ids)
    i = torch.arange(n - 1)
    tokens, index, valid = [], [], []
    for j in range(steps):
        at = i + 1 + j  # the target position this step predicts for
        inside = at <= n - 2
        tokens.append(torch.where(at <= n - 1, input_ids[at.clamp(max=n - 1)], 0))
        index.append(offset + at.clamp(max=n - 1))
        supervised = loss_mask[(at + 1).clamp(max=n - 1)].bool()
        valid.append(inside & supervised)
    return torch.stack(tokens), torch.stack(index), torch.stack(valid)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], steps: int) -> DraftBatch:
    """samples: (input_ids [n], loss_mask [n], hidden [n, H]) from the store, n ≥ 2."""
    offsets = np.cumsum([0] + [len(s[0]) for s in samples])
    parts = [align_sample(ids, mask, int(off), steps) for (ids, mask, _), off in zip(samples, offsets)]
    draft_lens = [len(s[0]) - 1 for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(draft_lens).cumsum(0)
    return DraftBatch(
        hidden_rows=torch.cat([torch.arange(int(off), int(off) + n) for off, n in zip(offsets, draft_lens)]),
        token_ids=torch.cat([p[0] for p in parts], 1),
        positions=torch.cat([torch.arange(n) for n in draft_lens]),
        segments=Segments(cu, max(draft_lens)),
        target_hidden=torch.cat([h for _, _, h in samples]),
        target_index=torch.cat([p[1] for p in parts], 1),
        valid=torch.cat([p[2] for p in parts], 1),
        tokens=int(offsets[-1]),
    )


def plan_micro_batches(lengths: np.ndarray, budget: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's micro-batches: a seeded shuffle, packed greedily up to `budget` tokens each.

    Samples longer than the budget get a micro-batch of their own.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    batches, current, used = [], [], 0
    for idx in order:
        n = int(lengths[idx])
        if n < 3:  # nothing to supervise
            continue
        if current and used + n > budget:
            batches.append(current)
            current, used = [], 0
        current.append(int(idx))
        used += n
    if current:
        batches.append(current)
    return batches


class MicroBatchPlan:
    """Global micro-batch g → sample indices, over as many epochs as needed; rank r of w takes g·w + r."""

    def __init__(self, lengths: np.ndarray, budget: int, seed: int):
        self.lengths, self.budget, self.seed = lengths, budget, seed
        self.epochs: list[list[list[int]]] = []
        self._planning = threading.Lock()

    def _epoch(self, e: int) -> list[list[int]]:
        # The prefetch threads ask at once: unlocked, two could append the same epoch twice and
        # shift every later micro-batch (a data order that differs run to run, a broken resume).
        with self._planning:
            while len(self.epochs) <= e:
                self.epochs.append(plan_micro_batches(self.lengths, self.budget, self.seed, len(self.epochs)))
            return self.epochs[e]

    @property
    def per_epoch(self) -> int:
        """Micro-batches in the first epoch (later epochs pack differently and may differ by a few)."""
        return len(self._epoch(0))

    def samples(self, global_index: int) -> list[int]:
        if self.per_epoch == 0:
            raise ValueError("the store has no sample with a supervised position (need ≥ 3 tokens)")
        epoch = 0
        while global_index >= len(self._epoch(epoch)):
            global_index -= len(self._epoch(epoch))
            epoch += 1
        return self._epoch(epoch)[global_index]
