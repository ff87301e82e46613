"""Where training's target states come from (`train.states`): a precomputed store, or the target
itself, run inside the training job ("online") when the store would not fit the disk.

Both give the trainer the same thing: the data's samples in the data loader's order (`lengths`),
and for a micro-batch's samples their (input_ids, loss_mask, states) with the states rounded as the
store holds them (`precompute.hidden_dtype`), the last layer's widened by the auxiliary layers the
head reads. So the micro-batch plan, the alignment, the masks and the losses are the same whichever
path a run takes (tests/test_online.py: equal losses, fp32).

    store   `StoreStates`: a finished store, verified, in loader order (its own order is by the
            rank and length that wrote each sample: a store precomputed on 8 GPUs trains in the
            order one precomputed on 1 does)
    online  `OnlineStates`: the data tokenized as precompute would, and each micro-batch's states
            from one packed forward of `inference_ref`'s target (compiled, FP8 where chosen,
            tensor-parallel over `model.tp_size` processes, the head trained data-parallel across
            the groups)
    auto    the store where there is one; else online when its estimate does not fit the free
            disk; else a one-line request to precompute it (or to choose online)

A store of N tokens needs N × (5 + layers × 2H) bytes (bf16): 8 TB per billion tokens of
Llama-3.1-8B, four times that for an EAGLE-3 head's four layers (`describe_choice` prints it).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.head_spec import HeadSpec
from mtp_train.data import Sample, load_samples
from mtp_train.store import Store, bytes_per_token

Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(input_ids [n] long, loss_mask [n] bool, states [n, L·H]) of one sample."""


class StoreStates:
    """A finished store, read in the data loader's order."""

    kind = "store"
    on_device = False
    lock = contextlib.nullcontext()
    """Nothing to hold: reading a store does not touch the GPU (see `OnlineStates.lock`)."""

    def __init__(self, store: Store):
        self.store = store
        self.order = np.argsort(store.sample_ids, kind="stable")
        self.lengths = store.lengths[self.order]

    def samples(self, ids: list[int]) -> list[Item]:
        return [self.store.sample(int(self.order[i])) for i in ids]

    def most_frequent_tokens(self, n: int, vocab_size: int) -> torch.Tensor:
        return self.store.most_frequent_tokens(n, vocab_size)

    @property
    def identity(self) -> str:
        """What a checkpoint records of its data: the shards' hashes, hashed."""
        shas = "".join(s["sha256"] for s in self.store.manifest["shards"])
        return hashlib.sha256(shas.encode()).hexdigest()[:16]

    def check(self, spec: HeadSpec, target_identity: dict, say=None) -> None:
        """The store's target, shards, counts, auxiliary layers and width against the head's (`say`:
        where the shards' hashing is announced)."""
        store = self.store
        store.check_target(target_identity)
        store.verify(say=say)  # every shard's sha256 (cached once verified) and the manifest's counts
        if len(store) == 0:
            raise ValueError(
                f"{store.path}: the store holds no sample (no supervised assistant tokens in the data?)"
            )
        needed, held = list(spec.aux_layers), store.aux_layers
        if needed and needed != held:
            raise ValueError(
                f"{store.path}: an {spec.variant} head fuses the target's layers {needed}, the store holds "
                f"{held or 'none'}: precompute a store with precompute.aux=true model.aux_layers={needed} "
                "(another precompute.store_dir), or train with train.states=online"
            )
        hidden = store.manifest["hidden_size"]
        if hidden != spec.target.hidden_size:
            raise ValueError(
                f"{store.path}: hidden size {hidden} does not match the head's target "
                f"({spec.target.hidden_size}); precompute the store with this target"
            )


class OnlineStates:
    """The target, run in the training job: one packed forward per micro-batch. `sharded`: the
    target is split over a tensor-parallel group, whose forwards run collectives (the training
    loop then keeps them in its own thread)."""

    kind = "online"

    def __init__(
        self,
        data: list[Sample],
        model,
        capture: tuple[int, ...],
        hidden_dtype: str,
        data_sha: str,
        sharded: bool = False,
    ):
        self.data, self.model, self.capture, self.sharded = data, model, capture, sharded
        self.lock = threading.Lock()
        """Held by each forward, and by the training loop while it validates."""
        self.hidden_dtype, self.data_sha = hidden_dtype, data_sha
        self.lengths = np.array([len(s.input_ids) for s in data], dtype=np.int64)
        self.on_device = model.norm.weight.device.type == "cuda"
        self.forward_s, self.tokens = 0.0, 0

    @torch.inference_mode()
    def samples(self, ids: list[int]) -> list[Item]:
        """The samples' states from one packed forward, checked finite and rounded as stored."""
        with self.lock:  # not while the training loop validates (its CUDA graph capture)
            return self._samples(ids)

    def _samples(self, ids: list[int]) -> list[Item]:
        from mtp_train.precompute import check_finite_states
        from mtp_train.validate.parity import round_as_stored

        started = time.perf_counter()
        device = self.model.norm.weight.device
        parts = [self.data[i] for i in ids]
        lengths = [len(s.input_ids) for s in parts]
        input_ids = torch.tensor([t for s in parts for t in s.input_ids], device=device)
        hidden, _ = self.model.forward_packed(input_ids, cu_seqlens_of(lengths, device), capture=self.capture)
        finite = torch.isfinite(hidden).all(-1).cpu()
        states = round_as_stored(hidden, self.hidden_dtype, 1 + len(self.capture))
        out = []
        for s, h, ok in zip(parts, states.split(lengths), finite.split(lengths)):
            check_finite_states(ok, s.source)
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            out.append((torch.tensor(s.input_ids), mask, h.clone()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # this device: a background thread's current one is GPU 0
        self.forward_s += time.perf_counter() - started
        self.tokens += sum(lengths)
        return out

    def most_frequent_tokens(self, n: int, vocab_size: int) -> torch.Tensor:
        """As `Store.most_frequent_tokens` counts them: supervised ids, ties to the lower id."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for s in self.data:
            ids = torch.tensor(s.input_ids)[torch.tensor(s.loss_mask, dtype=torch.bool)]
            counts += torch.bincount(ids, minlength=vocab_size)
        return torch.sort(-counts, stable=True).indices[:n].sort().values

    @property
    def identity(self) -> str:
        return f"online:{self.data_sha[:16]}"

    def check(self, spec: HeadSpec, target_identity: dict, say=None) -> None:
        if not len(self.data):
            raise ValueError("the data give no training sample (no supervised assistant tokens?)")

    def cost(self) -> str:
        """What the target's forwards have cost so far, in words."""
        if not self.tokens:
            return "online: no target forward yet"
        return (
            f"online: the target's forwards took {self.forward_s:.1f} s for {self.tokens:,} tokens "
            f"({self.tokens / self.forward_s:,.0f} tokens/s)"
        )


def tokenized(cfg, target_dir: Path) -> list[Sample]:
    """The training samples as precompute tokenizes them (refused in one line where none is left)."""
    from transformers import AutoTokenizer

    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty: name the conversation files to train on")
    samples, counts = load_samples(cfg.data, AutoTokenizer.from_pretrained(str(target_dir)))
    if not samples:
        raise ValueError(
            f"data.train_files {list(cfg.data.train_files)} give no training sample: {counts['records']} "
            f"records, {counts['dropped']} dropped as longer than data.max_seq_len, "
            f"{counts['unsupervised']} without a supervised (assistant) token"
        )
    return samples


def store_estimate(samples: list[Sample], spec: HeadSpec, hidden_dtype: str) -> int:
    """Bytes a store of these samples would take for this head (its auxiliary layers included)."""
    per_token = bytes_per_token(spec.target.hidden_size, hidden_dtype, 1 + len(spec.aux_layers))
    return sum(len(s.input_ids) for s in samples) * per_token


def choose(cfg, spec: HeadSpec, target_dir: Path, say=print) -> tuple[str, list[Sample] | None]:
    """`train.states`, with `auto` resolved and the reason said; the tokenized data where the
    choice needed it (online reuses it)."""
    mode, store_dir = cfg.train.states, Path(cfg.train.store_dir)
    started = any((store_dir / name).exists() for name in ("manifest.json", "run.json"))
    if mode == "store" or (mode == "auto" and started):  # (an unfinished one says so when opened)
        if mode == "auto":
            say(f"train: states from the store {store_dir} (train.states=auto: a store is there)")
        return "store", None
    samples = tokenized(cfg, target_dir)
    estimate = store_estimate(samples, spec, cfg.precompute.hidden_dtype)
    free = shutil.disk_usage(nearest_existing(store_dir)).free
    sizes = f"a store would take {size(estimate)}, {size(free)} is free under {store_dir.parent}"
    if mode == "online":
        say(f"train: states online (train.states=online): the target runs in this job; {sizes}")
        return "online", samples
    if estimate < free:
        raise ValueError(
            f"train.states=auto: no store at {store_dir} and {sizes}: precompute it "
            "(python -m mtp_train.precompute …), or train with train.states=online"
        )
    say(f"train: states online (train.states=auto): no store at {store_dir} and {sizes}")
    return "online", samples


def nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"
