"""Precompute the target's last-layer hidden states into a store: `python -m mtp_train.precompute`.

    for each packed batch of similar-length samples (longest first):
        hidden = target.forward_packed(tokens)          # GPU, bf16, no padding
        hidden → fp8 (optional) → pinned CPU memory      # non-blocking copy
        queue → writer thread → shards                   # disk overlaps the next forward
    full shards: commit threads write, hash, fsync, rename, journal (mtp_train.store)

On one H200 (a random 0.6B Llama, H=2048, 8 layers, 1.3M tokens) the forward alone runs at
~330k tokens/s and the whole precompute keeps pace with it: writing a bf16 store at that rate is
~1.3 GB/s, which is why shards are committed by two threads with hashing overlapped with writing.

Under `accelerate launch` sample k goes to data-parallel rank k % world; each writes its own shards
and, after a barrier, rank 0 merges the ranks' shard lists into `manifest.json`. With
`model.tp_size` > 1 a data-parallel rank is a group of tp_size processes sharding the target
(`mtp_train.parallel`): all of them forward, the group's leader writes. A rerun after a crash
skips the samples in journaled shards (see `mtp_train.store`); a rerun of a finished store does nothing.
"""

from __future__ import annotations

from mtp_train.cli import answer_help_first

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.locks import exclusive

answer_help_first(__name__, __file__)  # before torch & co.: they take seconds to import

import hashlib
import json
import queue
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.head_spec import check_aux_layers
from inference_ref.quantization import calibration
from inference_ref.target import TargetModel, load_target
from mtp_train import config as _config  # noqa: F401  (registers the Hydra schema)
from mtp_train.cli import one_line_errors
from mtp_train.data import Sample, load_samples
from mtp_train.parallel import Ranks, launched_ranks
from mtp_train.run import Target, aux_layers_of
from mtp_train.store import (
    FORMAT,
    VERSION,
    Record,
    ShardWriter,
    bytes_per_token,
    dequantize_fp8,
    merge_manifests,
    quantize_fp8,
    write_json_atomic,
)
from mtp_train.target_files import check_same_target, model_dtype

DISK_MARGIN_BYTES = 1 << 30  # free space kept beyond the estimate: logs, checkpoints, a wrong guess
DISK_MARGIN_FRACTION = 0.05
WRITE_QUEUE_DEPTH = 4  # batches in flight to the writer; each holds tokens_per_batch × bytes/token


@dataclass
class RankJob:
    """One rank's share of a precompute run."""

    store_dir: Path
    target_dir: Path
    rank: int
    world: int
    samples: list[Sample]  # all samples: ids index this list; this rank takes k % world == rank
    header: dict  # the run's fixed settings, written to run.json and into the manifest
    tokens_per_batch: int
    shard_tokens: int
    hidden_dtype: str
    model_dtype: str
    compile: bool
    capture: tuple[int, ...] = ()
    """Auxiliary layers whose entering states are stored beside the last layer's (eagle3)."""
    quantization: str = "none"
    """`model.quantization` of the target that computes the states."""

    @property
    def complete(self) -> bool:
        return (self.store_dir / "manifest.json").exists()


def run_precompute(cfg) -> Path:
    """Write (or finish) the store for `cfg.model.target` × `cfg.data`; returns the store directory."""
    with exclusive(cfg.precompute.store_dir, "precompute.store_dir"):  # one writer per store
        return _run_precompute(cfg)


def _run_precompute(cfg) -> Path:
    ranks = launched_ranks(cfg.model.tp_size)
    job = prepare(cfg, ranks.dp_rank, ranks.dp_size, ranks.device, verbose=ranks.main)
    if job.complete:
        if ranks.main:
            print(f"precompute: {job.store_dir} is already complete")
        return job.store_dir
    check_disk(job.store_dir, job.header, verbose=ranks.main)
    precompute_rank(job, ranks)
    barrier()
    if ranks.main:
        manifest = merge_manifests(job.store_dir, job.header)
        print(f"precompute: {describe(manifest)} → {job.store_dir}")
    barrier()
    return job.store_dir


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def prepare(cfg, rank: int, world: int, device: torch.device | str = "cpu", verbose: bool = False) -> RankJob:
    """Tokenize the data, fix the run's settings, and claim (or re-check) the store directory.
    `device`: where the forwards run, which `model.dtype=auto` resolves on; `verbose`: the main
    rank's, which announces the tokenization."""
    _config.checked(cfg)
    if not cfg.data.train_files:
        raise _config.ConfigError("data.train_files is empty: name the conversation files to precompute")
    from transformers import AutoTokenizer

    target = Target.resolve(cfg.model.target)
    tokenizer = AutoTokenizer.from_pretrained(str(target.dir))
    if verbose:  # the chat template rendered per turn: minutes for a million conversations
        print(f"precompute: tokenizing data.train_files {list(cfg.data.train_files)}", flush=True)
    samples, counts = load_samples(cfg.data, tokenizer)
    if not samples:
        raise ValueError(
            f"data.train_files {list(cfg.data.train_files)} give no training sample: {counts['records']} "
            f"records after data.holdout {cfg.data.holdout}, {counts['dropped']} dropped as longer than "
            f"data.max_seq_len, {counts['unsupervised']} without a supervised (assistant) token"
        )
    header = run_header(
        cfg, target, samples, counts, world, model_dtype(cfg.model.dtype, torch.device(device))
    )
    store_dir = Path(cfg.precompute.store_dir)
    claim_store_dir(store_dir, header)
    pc = cfg.precompute
    return RankJob(
        store_dir=store_dir,
        target_dir=target.dir,
        rank=rank,
        world=world,
        samples=samples,
        header=header,
        tokens_per_batch=pc.tokens_per_batch,
        shard_tokens=pc.shard_tokens,
        hidden_dtype=pc.hidden_dtype,
        model_dtype=header["compute_dtype"],  # resolved once: every rank and resumed run computes alike
        compile=pc.compile,
        capture=tuple(header.get("aux_layers", ())),
        quantization=cfg.model.quantization,
    )


def run_header(
    cfg, target: Target, samples: list[Sample], counts: dict, world: int, compute_dtype: torch.dtype
) -> dict:
    """The manifest fields fixed before any compute. `compute_dtype`: the target's, `model.dtype`
    resolved (a store resumed in another dtype would mix states rounded two ways)."""
    hidden_size = target.config.hidden_size
    aux = list(aux_layers_of(cfg.model, target.config)) if cfg.precompute.aux else []
    if aux:
        check_aux_layers(tuple(aux), target.config.num_hidden_layers, "model.aux_layers")
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": target.identity,
        "hidden_size": hidden_size,
        "hidden_dtype": cfg.precompute.hidden_dtype,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        **({"aux_layers": aux} if aux else {}),  # absent from stores without (and from older ones)
        **({"target_quantization": cfg.model.quantization} if cfg.model.quantization != "none" else {}),
        "bytes_per_token": bytes_per_token(hidden_size, cfg.precompute.hidden_dtype, 1 + len(aux)),
        "world_size": world,
        "data": {
            "config": OmegaConf.to_container(OmegaConf.structured(cfg.data), resolve=True),
            "counts": counts,
            "num_samples": len(samples),
            "num_tokens": sum(len(s.input_ids) for s in samples),
            "sha256": data_hash(samples),
        },
    }


def data_hash(samples: list[Sample]) -> str:
    """Fingerprint of the tokenized samples: a resumed run must see exactly the same data."""
    h = hashlib.sha256()
    for s in samples:
        h.update(struct.pack("<q", len(s.input_ids)))
        h.update(np.asarray(s.input_ids, dtype=np.int32).tobytes())
        h.update(np.asarray(s.loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def claim_store_dir(store_dir: Path, header: dict) -> None:
    """Record the run's settings in a new store, or refuse to resume one started with other settings."""
    path = store_dir / "run.json"
    if not path.exists():
        store_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, header)
        return
    old = json.loads(path.read_text())
    check_same_target(header["target"], old["target"], f"store {store_dir}")
    keys = [
        ("hidden_dtype",),
        ("compute_dtype",),
        ("aux_layers",),
        ("target_quantization",),
        ("data", "sha256"),
    ]
    if not (store_dir / "manifest.json").exists():
        keys.append(("world_size",))  # a resumed rank continues its own journal: same ranks needed
    for key in keys:
        was, now = _get(old, key), _get(header, key)
        if was != now and not (key in RECORDED_LATER and was is None):
            what = ".".join(key)
            raise ValueError(
                f"store {store_dir} was started with {what} {was!r}, this run has {now!r}: "
                "resume with the same settings, or choose another precompute.store_dir"
            )


RECORDED_LATER = {("compute_dtype",)}
"""Settings that stores started before they were recorded lack: not compared there."""


def _get(d: dict, key: tuple[str, ...]):
    """The nested value at `key`, None where a key is absent (a store without auxiliary layers)."""
    for k in key:
        d = d.get(k) if isinstance(d, dict) else None
    return d


class DiskFull(ValueError):
    """The disk cannot hold the store: the user frees space or chooses another place (one line)."""


def check_disk(store_dir: Path, header: dict, verbose: bool = True) -> None:
    """Print the store's size estimate; refuse to start when the disk cannot hold the rest of it."""
    estimate = header["data"]["num_tokens"] * header["bytes_per_token"]
    written = sum(p.stat().st_size for p in store_dir.glob("shard-*.safetensors"))
    needed = max(estimate - written, 0)
    margin = int(DISK_MARGIN_BYTES + DISK_MARGIN_FRACTION * needed)
    free = shutil.disk_usage(store_dir).free
    if verbose:
        print(
            f"precompute: store estimate {_size(estimate)} ({header['data']['num_tokens']:,} tokens × "
            f"{header['bytes_per_token']} B/token, {header['hidden_dtype']}), "
            f"{_size(written)} already written, {_size(free)} free in {store_dir}"
        )
    if free < needed + margin:
        raise DiskFull(
            f"not enough disk for the store in {store_dir}: it needs {_size(needed)} more "
            f"(+ {_size(margin)} margin) but only {_size(free)} is free; free space, pass "
            "precompute.hidden_dtype=fp8 (half the size), or choose another precompute.store_dir"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(manifest: dict) -> str:
    err = manifest["fp8_rel_rms_error"]
    quality = "" if err is None else f", fp8 relative RMS error {err:.2e}"
    c = manifest["data"]["counts"]
    kept = (
        f"{c['records']:,} records → {manifest['num_samples']:,} samples kept ({c['truncated']:,} truncated "
        f"to data.max_seq_len, {c['dropped']:,} dropped as over-long, {c['unsupervised']:,} without a "
        f"supervised token)"
    )
    return f"{kept}, {manifest['num_tokens']:,} tokens in {len(manifest['shards'])} shards{quality}"


# ---------------------------------------------------------------------------------------------
# One rank's work


def precompute_rank(job: RankJob, ranks: Ranks) -> None:
    """Forward this data-parallel rank's not-yet-stored samples and write them; then write the
    rank's manifest. In a tensor-parallel group every rank runs the forwards, the leader writes."""
    writer = (
        ShardWriter(job.store_dir, job.rank, job.shard_tokens, job.hidden_dtype) if ranks.leader else None
    )
    done = ranks.broadcast(writer.done_ids() if writer else None)
    todo = [k for k in range(job.rank, len(job.samples), job.world) if k not in done]
    if done and ranks.leader:
        print(f"precompute rank {job.rank}: resuming, {len(done)} samples stored, {len(todo)} to go")
    if todo:
        dtype = model_dtype(job.model_dtype, ranks.device)
        say = print if ranks.main else None
        model = load_target(
            job.target_dir, ranks.device, dtype, job.compile, job.quantization, ranks.tp_mesh, say=say
        )
        if job.quantization == "fp8_static":
            calibrate_static_fp8(model, job)
        started = time.perf_counter()
        tokens = write_hidden_states(model, job, todo, writer)
        seconds = time.perf_counter() - started
        # per rank and without the model's load, so that N ranks can be set against one
        if ranks.leader:
            print(
                f"precompute rank {job.rank}: {tokens:,} tokens in {seconds:.1f} s ({tokens / seconds:,.0f} tok/s)"
            )
    if writer:
        writer.finish()


FP8_CALIBRATION_TOKENS = 8192
"""`model.quantization=fp8_static`: the data's first this many tokens (whole samples, at least one)
set the input scales; a fixed budget, not `tokens_per_batch`, so that a run resumed with smaller
batches (after running out of memory) keeps its scales."""


def calibrate_static_fp8(model: TargetModel, job: RankJob) -> None:
    """`model.quantization=fp8_static`: each linear map's input scale from an eager forward of the
    data's first `FP8_CALIBRATION_TOKENS` tokens, in the data's own order, whichever rank this is
    and whatever is stored already, so that every rank and every resumed run has the same scales."""
    first, tokens = [], 0
    for k, sample in enumerate(job.samples):
        if first and tokens + len(sample.input_ids) > FP8_CALIBRATION_TOKENS:
            break
        first.append(k)
        tokens += len(sample.input_ids)
    with torch.inference_mode(), calibration(model):
        forward_batch(model, job.samples, first, job.hidden_dtype, job.capture, copy=False)
    print(f"precompute rank {job.rank}: static FP8 input scales calibrated on {tokens:,} tokens")


def write_hidden_states(model: TargetModel, job: RankJob, todo: list[int], writer: ShardWriter | None) -> int:
    """Forward the `todo` samples and store them (`writer`; None: a tensor-parallel rank that only
    computes its part); returns the tokens forwarded."""
    lengths = {k: len(job.samples[k].input_ids) for k in todo}
    total = sum(lengths.values())
    # tqdm's rate and ETA are in tokens; one bar (rank 0) stands for all ranks, which run in step.
    bar = tqdm(
        total=total, unit="tok", unit_scale=True, desc="precompute", disable=job.rank != 0 or not writer
    )
    background = BackgroundWriter(writer, WRITE_QUEUE_DEPTH) if writer else None
    try:
        with torch.inference_mode():
            for ids in pack_by_length(todo, lengths, job.tokens_per_batch):
                batch = forward_batch(
                    model, job.samples, ids, job.hidden_dtype, job.capture, copy=bool(writer)
                )
                if background:
                    background.put(batch)
                bar.update(sum(lengths[k] for k in ids))
    finally:
        if background:
            background.close()
        bar.close()
    return total


def pack_by_length(ids: list[int], lengths: dict[int, int], budget: int) -> list[list[int]]:
    """Batches of ≤ `budget` tokens (a longer sample alone), longest samples first: similar lengths
    share a batch, and an out-of-memory shows up at the first batch rather than hours in."""
    batches, current, tokens = [], [], 0
    for k in sorted(ids, key=lambda k: (-lengths[k], k)):
        if current and tokens + lengths[k] > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(k)
        tokens += lengths[k]
    return batches + [current] if current else batches


@dataclass
class HostBatch:
    """A forwarded batch on its way to the writer: CPU tensors, maybe still being copied."""

    sample_ids: list[int]
    lengths: list[int]
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    hidden: torch.Tensor  # [T, L·H] bf16 or e4m3 (L = 1 + aux layers)
    hidden_scale: torch.Tensor | None  # [T] or [T, L] (fp8)
    sq_err: torch.Tensor | None  # [T] Σ_h (dequantized − bf16)² (fp8)
    sq_ref: torch.Tensor | None  # [T] Σ_h bf16² (fp8)
    finite: torch.Tensor  # [T] bool: every state of the token is finite
    copied: torch.cuda.Event | None  # set once the device → host copies are done
    sources: list[str] | None = None  # the samples' `file:N`, for the message

    def records(self) -> Iterator[Record]:
        if self.copied is not None:
            self.copied.synchronize()
        bounds = np.cumsum([0] + self.lengths).tolist()
        fp8 = self.hidden_scale is not None
        for i, (k, a, b) in enumerate(zip(self.sample_ids, bounds[:-1], bounds[1:])):
            source = self.sources[i] if self.sources else f"sample {k}"
            check_finite_states(self.finite[a:b], source)
            yield Record(
                k,
                self.input_ids[a:b],
                self.loss_mask[a:b],
                self.hidden[a:b],
                self.hidden_scale[a:b] if fp8 else None,
                float(self.sq_err[a:b].sum()) if fp8 else 0.0,
                float(self.sq_ref[a:b].sum()) if fp8 else 0.0,
            )


def forward_batch(
    model: TargetModel,
    samples: list[Sample],
    ids: list[int],
    hidden_dtype: str,
    capture: tuple[int, ...] = (),
    copy: bool = True,
) -> HostBatch | None:
    """Run one packed batch and start copying its (encoded) hidden states to pinned host memory:
    the last layer's, widened by the `capture` layers' (`causal_lm.widened`). `copy=False`: the
    forward only (a tensor-parallel rank whose leader writes)."""
    device = model.norm.weight.device
    lengths = [len(samples[k].input_ids) for k in ids]
    input_ids = torch.tensor([t for k in ids for t in samples[k].input_ids], dtype=torch.int32)
    loss_mask = torch.tensor([m for k in ids for m in samples[k].loss_mask], dtype=torch.uint8)
    hidden, _ = model.forward_packed(
        input_ids.to(device, torch.long), cu_seqlens_of(lengths, device), capture=capture
    )
    if not copy:
        return None
    encoded = encode_hidden(hidden, hidden_dtype, 1 + len(capture))
    # per token on the device, checked on the host as each record is written: no sync here
    finite = torch.isfinite(hidden).all(-1)
    host = [None if t is None else to_host(t) for t in (*encoded, finite)]
    copied = None
    if device.type == "cuda":
        copied = torch.cuda.Event()
        copied.record()
    return HostBatch(ids, lengths, input_ids, loss_mask, *host, copied, [samples[k].source for k in ids])


class NonFiniteStates(FloatingPointError):
    """The target computed NaN or inf states for a sample: it is not stored (nor anything after)."""


def check_finite_states(finite: torch.Tensor, source: str) -> None:
    """Refuse a sample whose target states are not all finite (a target that overflows in its
    dtype, damaged weights): a head trained on them learns nothing, or NaN."""
    if bool(finite.all()):
        return
    bad = (~finite).nonzero().flatten()
    raise NonFiniteStates(
        f"{source}: the target's states are NaN or inf at {len(bad)} of {len(finite)} tokens (first at "
        f"token {int(bad[0])}); not stored, and the samples stored before it are kept. Check the target's "
        "weights, or run it in float32 (model.dtype)"
    )


def encode_hidden(hidden: torch.Tensor, hidden_dtype: str, layers: int = 1):
    """(stored, scale, sq_err, sq_ref) on the device: bf16 as is, or fp8 (one scale per token and
    layer) with its error against bf16."""
    ref = hidden.to(torch.bfloat16)
    if hidden_dtype == "bf16":
        return ref, None, None, None
    q, scale = quantize_fp8(hidden, layers)
    err = dequantize_fp8(q, scale).float() - ref.float()
    return q, scale, err.pow(2).sum(-1), ref.float().pow(2).sum(-1)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """CPU copy; from CUDA into pinned memory without blocking, so the next forward queues at once."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


class BackgroundWriter:
    """Feeds batches to a ShardWriter from a thread, at most `depth` batches behind the forwards."""

    def __init__(self, writer: ShardWriter, depth: int):
        self.writer, self.queue, self.error = writer, queue.Queue(maxsize=depth), None
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is not None:
                continue  # keep draining so that put() never blocks; the error is raised there
            try:
                for record in batch.records():
                    self.writer.add(record)
            except BaseException as e:
                self.error = e

    def put(self, batch: HostBatch) -> None:
        self._raise()
        self.queue.put(batch)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if isinstance(self.error, NonFiniteStates):
            raise self.error  # bad input, named in one line: no wrapping
        if self.error is not None:
            raise RuntimeError("writing the store failed") from self.error


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
@one_line_errors
def main(cfg) -> None:
    run_precompute(cfg)


if __name__ == "__main__":
    main()
