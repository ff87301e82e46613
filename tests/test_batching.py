"""The micro-batch prefetcher keeps order, runs ahead, and surfaces a loader's error."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mtp_train.batching import MicroBatchPlan, prefetched


def test_prefetched_keeps_order_and_loads_ahead_on_another_thread():
    started: list[int] = []
    threads: set[int] = set()

    def load(key: int) -> int:
        started.append(key)
        threads.add(threading.get_ident())
        return key * key

    out = []
    for item in prefetched(load, range(6), depth=2):
        time.sleep(0.05)  # the "GPU step": by now the next key has been started
        out.append(item)
        assert len(started) >= min(6, len(out) + 1)
    assert out == [k * k for k in range(6)]
    assert threading.get_ident() not in threads


def test_prefetched_raises_the_loaders_error_at_its_item():
    def load(key: int) -> int:
        if key == 3:
            raise ValueError("shard 7 is corrupted")
        return key

    got = []
    with pytest.raises(ValueError, match="shard 7"):
        for item in prefetched(load, range(6)):
            got.append(item)
    assert got == [0, 1, 2]


def test_two_builders_keep_the_order_when_a_later_key_finishes_first():
    """With two workers a quick later load can finish before a slow earlier one; items still
    come out in key order (the data order, hence exact resume, does not depend on timing)."""

    def load(key: int) -> int:
        time.sleep(0.06 if key % 2 == 0 else 0.0)  # even keys slow
        return key

    assert list(prefetched(load, range(8), depth=3, workers=2)) == list(range(8))


def test_micro_batch_plan_is_the_same_when_prefetch_threads_race():
    """Two prefetch threads asking a fresh plan for its micro-batches at once give the order one
    thread gives (before the lock, 23 of 300 plans appended an epoch twice and diverged)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 200, size=64)
    reference = [MicroBatchPlan(lengths, 512, 0).samples(g) for g in range(40)]
    for _ in range(100):
        plan = MicroBatchPlan(lengths, 512, 0)
        assert list(prefetched(plan.samples, range(40), 3, 2)) == reference
