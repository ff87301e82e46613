"""The precomputed store: tokens, loss masks and the target's last-layer hidden states (pre final norm).

Layout of a store directory:

    manifest.json                        written last, by rank 0: the store is complete iff it exists
    run.json                             the run's fixed settings (target, data hash, dtype, world size)
    shard-{rank:05d}-{index:05d}.safetensors
    journal-{rank:05d}.jsonl             one line per committed shard of that rank (crash recovery)
    rank-{rank:05d}.json                 that rank's shard list, written when the rank has finished

Each shard packs whole samples end to end (S samples, N tokens):

    offsets      int64 [S+1]   sample s is rows offsets[s] : offsets[s+1]
    sample_ids   int64 [S]     position of each sample in the data loader's order
    input_ids    int32 [N]
    loss_mask    uint8 [N]     1 on supervised (assistant) tokens
    hidden       bf16 [N, L·H] or float8_e4m3fn [N, L·H] with
    hidden_scale fp32 [N] (L = 1) or [N, L]: per token (and layer) scale (fp8 only): hidden ≈ fp8 × scale

L = 1 + the auxiliary layers kept (`aux_layers` in the manifest, for eagle3 heads): the last layer's
state first, then the states entering those layers (`causal_lm.widened`).
Storage per token: bf16 `2·L·H + 5` bytes (H=4096, L=1: 8.0 KiB), fp8 `L·(H + 4) + 5` bytes
(H=4096, L=1: 4.0 KiB), plus 16 bytes per sample. fp8 halves the store; its cost, the relative RMS error of the dequantized
states against bf16, is measured while writing and recorded in the manifest (`fp8_rel_rms_error`):
2.2–2.7% on random-weight targets (e4m3 keeps 3 mantissa bits). Real targets have outlier channels
that a per-token scale spends range on; read the manifest's figure for the target at hand.

Crash safety: a shard is written to a `.tmp` file, fsynced and renamed, and only then journaled.
A shard file that is not in the journal was in flight at a crash (shards commit in parallel, so
there may be two) and is discarded on restart, so a rerun redoes exactly the samples not in
journaled shards: none lost, none twice.
Readers memory-map the shards (no file descriptor is held per shard).
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.cli import answer_help_first, one_line_errors

USAGE = """usage: python -m mtp_train.store verify|repair STORE_DIR [--cached]
  verify  check the manifest's counts and re-hash every shard (--cached: trust shards whose size
          and modification time are those they had when they last hashed right, as training does)
  repair  drop damaged or missing shards (rerunning precompute recomputes their samples)"""
answer_help_first(__name__, __file__, USAGE)  # before torch: it takes seconds to import

import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mtp_train.target_files import check_same_target

FORMAT = "mtp-train-store"
VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
HIDDEN_DTYPES = ("bf16", "fp8")

_SAFETENSORS_DTYPE = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}
_TORCH_DTYPE = {name: dtype for dtype, name in _SAFETENSORS_DTYPE.items()}


def bytes_per_token(hidden_size: int, hidden_dtype: str, layers: int = 1) -> int:
    """Stored bytes per token: ids (4) + mask (1) + `layers` states (2H bf16, or H fp8 + 4 for the scale)."""
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype!r}")
    per_layer = 2 * hidden_size if hidden_dtype == "bf16" else hidden_size + 4
    return layers * per_layer + 5


def shard_name(rank: int, index: int) -> str:
    return f"shard-{rank:05d}-{index:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# fp8


def quantize_fp8(hidden: torch.Tensor, layers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, L·H] → (e4m3 [T, L·H], fp32 scale [T] for L = 1, else [T, L]): each token's state of each
    layer scaled so its absmax maps to 448 (layers differ in magnitude by orders)."""
    h = hidden.float().unflatten(-1, (layers, -1))
    scale = h.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    # Clamp: rounding can put h / scale a hair past 448, which e4m3fn would turn into NaN.
    q = (h / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale[:, 0] if layers == 1 else scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale if scale.dim() == 2 else scale[:, None]
    return (q.float().unflatten(-1, (scale.shape[1], -1)) * scale[..., None]).flatten(-2).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class Record:
    """One sample as it goes into a shard (CPU tensors)."""

    sample_id: int
    input_ids: torch.Tensor  # [n] integer
    loss_mask: torch.Tensor  # [n] bool or uint8
    hidden: torch.Tensor  # [n, L·H] bf16, or e4m3 with hidden_scale (L = 1 + aux layers)
    hidden_scale: torch.Tensor | None = None  # [n] (L = 1) or [n, L] fp32, fp8 only
    sq_err: float = 0.0  # Σ (dequantized − bf16)² over the sample (fp8 only)
    sq_ref: float = 0.0  # Σ bf16² over the sample (fp8 only)

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


class Journal:
    """Append-only jsonl of one rank's committed shards. A line is appended (and fsynced) only
    after its shard file is in place, so every journaled shard is complete on disk."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if complete != data:  # a line torn by a crash mid-append: its shard is not committed
            os.truncate(self.path, len(complete))
        return [self._entry(lineno, line) for lineno, line in enumerate(complete.splitlines(), 1)]

    def _entry(self, lineno: int, line: bytes) -> dict:
        """One journaled shard, refused (before anything is deleted) if the line is damaged."""
        try:
            entry = json.loads(line)
            if entry["file"] != shard_name(entry["rank"], entry["index"]) or not isinstance(
                entry["sha256"], str
            ):
                raise ValueError("fields disagree")
            return entry
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{self.path}:{lineno}: damaged journal line ({type(e).__name__}); delete that line "
                "and rerun precompute: its shard's samples are computed again"
            ) from None

    def rewrite(self, entries: list[dict]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        os.replace(tmp, self.path)

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


class ShardWriter:
    """Appends one rank's samples to its shards, closing a shard at the first sample boundary
    past `shard_tokens`. Reopening after a crash picks up from the journal.

    Full shards are written by `commit_threads` threads while the next one fills (writing,
    hashing and fsyncing 1 GiB takes seconds, as long as the forward passes that produced it on a
    small target). Host memory held: up to `commit_threads + 1` shards."""

    def __init__(
        self,
        store_dir: str | Path,
        rank: int,
        shard_tokens: int,
        hidden_dtype: str = "bf16",
        commit_threads: int = 2,
    ):
        bytes_per_token(1, hidden_dtype)  # validates the name
        self.dir, self.rank = Path(store_dir), rank
        self.shard_tokens, self.hidden_dtype = shard_tokens, hidden_dtype
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.dir / f"journal-{rank:05d}.jsonl")
        self.shards = self.journal.read()
        self._discard_uncommitted()
        self._drop_damaged()
        # Shards commit out of order, so after a crash the journal may have gaps: continue past the last.
        self.next_index = max((e["index"] for e in self.shards), default=-1) + 1
        self.pending: list[Record] = []
        self.pending_tokens = 0
        self.commit_threads = commit_threads
        self._pool = ThreadPoolExecutor(commit_threads, thread_name_prefix=f"shard-commit-{rank}")
        self._in_flight: list[Future] = []
        self._lock = threading.Lock()  # journal and shard list, shared by the commit threads

    def _discard_uncommitted(self) -> None:
        """Drop this rank's temp files and shard files the journal does not list (in flight at a crash)."""
        committed = {entry["file"] for entry in self.shards}
        for path in self.dir.glob(f"shard-{self.rank:05d}-*"):
            if path.name not in committed:
                path.unlink()

    def _drop_damaged(self) -> None:
        """A resumed rank re-hashes its journaled shards: one damaged or deleted since it was written
        leaves the journal and is computed again, rather than being published in the manifest
        unchecked (or stopping the store for good: `repair` needs a manifest to work from)."""
        if self.shards:  # every committed shard read whole: minutes for hundreds of GB
            files = [self.dir / e["file"] for e in self.shards]
            size = sum(f.stat().st_size for f in files if f.exists())
            print(
                f"precompute rank {self.rank}: checking {len(self.shards)} committed shards "
                f"({size / 1e9:.1f} GB) before resuming",
                flush=True,
            )
        problems = {e["file"]: shard_problem(self.dir / e["file"], e["sha256"]) for e in self.shards}
        damaged = [e for e in self.shards if problems[e["file"]]]
        for entry in damaged:
            print(
                f"precompute rank {self.rank}: {entry['file']} is {problems[entry['file']]}; its samples are computed again"
            )
            (self.dir / entry["file"]).unlink(missing_ok=True)
        if damaged:
            self.shards = [e for e in self.shards if e not in damaged]
            self.journal.rewrite(self.shards)

    def done_ids(self) -> set[int]:
        """Sample ids already in this rank's committed shards."""
        return {int(i) for e in self.shards for i in read_shard(self.dir / e["file"])["sample_ids"]}

    def add(self, record: Record) -> None:
        self.pending.append(record)
        self.pending_tokens += record.tokens
        if self.pending_tokens >= self.shard_tokens:
            self._commit()

    def wait(self) -> None:
        """Block until every full shard handed to the commit threads is written and journaled."""
        while self._in_flight:
            self._in_flight.pop(0).result()

    def finish(self) -> dict:
        """Commit the last partial shard, wait for all commits, and write this rank's manifest."""
        if self.pending:
            self._commit()
        self.wait()
        self._pool.shutdown()
        self.shards.sort(key=lambda e: e["index"])
        summary = {"rank": self.rank, "shards": self.shards}
        write_json_atomic(self.dir / f"rank-{self.rank:05d}.json", summary)
        return summary

    def _commit(self) -> None:
        # Waiting for the oldest commit bounds memory, and re-raises a failed commit here.
        while len(self._in_flight) >= self.commit_threads:
            self._in_flight.pop(0).result()
        records, self.pending, self.pending_tokens = self.pending, [], 0
        self._in_flight.append(self._pool.submit(self._write_shard, self.next_index, records))
        self.next_index += 1

    def _write_shard(self, index: int, records: list[Record]) -> None:
        """File first (tmp, fsync, rename), journal line second: a journaled shard is complete."""
        name = shard_name(self.rank, index)
        tmp = self.dir / (name + ".tmp")
        metadata = {"format": FORMAT, "hidden_dtype": self.hidden_dtype}
        sha, size = write_safetensors(tmp, self._tensors(records), metadata)
        os.replace(tmp, self.dir / name)
        fsync_dir(self.dir)
        entry = {
            "file": name,
            "rank": self.rank,
            "index": index,
            "samples": len(records),
            "tokens": sum(r.tokens for r in records),
            "loss_tokens": sum(int(r.loss_mask.sum()) for r in records),
            "bytes": size,
            "sha256": sha,
            "sq_err": sum(r.sq_err for r in records),
            "sq_ref": sum(r.sq_ref for r in records),
        }
        with self._lock:
            self.journal.append(entry)
            self.shards.append(entry)

    def _tensors(self, records: list[Record]) -> dict[str, list[torch.Tensor]]:
        """The samples as lists of chunks per tensor, in decreasing element size
        (so every tensor's data stays aligned for zero-copy memory-mapped views)."""
        lengths = torch.tensor([0] + [r.tokens for r in records], dtype=torch.int64)
        fp8 = self.hidden_dtype == "fp8"
        tensors = {
            "offsets": [lengths.cumsum(0)],
            "sample_ids": [torch.tensor([r.sample_id for r in records], dtype=torch.int64)],
            "hidden_scale": [r.hidden_scale.float() for r in records] if fp8 else [],
            "input_ids": [r.input_ids.to(torch.int32) for r in records],
            "hidden": [r.hidden for r in records],
            "loss_mask": [r.loss_mask.to(torch.uint8) for r in records],
        }
        return {name: chunks for name, chunks in tensors.items() if chunks}


def write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]):
    """Stream each tensor's chunks (concatenated along dim 0) into a safetensors file, fsynced,
    without building the concatenated tensors in memory. Returns (sha256, size in bytes)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, chunks in tensors.items():
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        shape = [sum(c.shape[0] for c in chunks), *chunks[0].shape[1:]]
        dtype = _SAFETENSORS_DTYPE[chunks[0].dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    blocks = [memoryview(struct.pack("<Q", len(head))), memoryview(head)]
    blocks += [_raw_bytes(c) for chunks in tensors.values() for c in chunks]
    # Hash in a second thread while this one writes: both release the GIL, and each alone is ~1 GB/s.
    with ThreadPoolExecutor(1) as hasher:
        sha = hasher.submit(_sha256, blocks)
        with open(path, "wb") as f:
            for block in blocks:
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    return sha.result(), sum(b.nbytes for b in blocks)


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _sha256(blocks: list[memoryview]) -> str:
    h = hashlib.sha256()
    for block in blocks:
        h.update(block)
    return h.hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (survives power loss, not only a killed process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def merge_manifests(store_dir: str | Path, header: dict) -> dict:
    """Rank 0, once every rank has finished: all ranks' shards into `manifest.json`.

    `header` holds the run's fixed fields (see `precompute.run_header`); its `world_size` says
    which rank manifests to expect and `data.num_samples` how many samples they must hold."""
    store_dir = Path(store_dir)
    shards = []
    for rank in range(header["world_size"]):
        path = store_dir / f"rank-{rank:05d}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: rank {rank} has not finished; rerun precompute to resume")
        shards += json.loads(path.read_text())["shards"]
    sq_err, sq_ref = sum(s["sq_err"] for s in shards), sum(s["sq_ref"] for s in shards)
    manifest = {
        **header,
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": sum(s["loss_tokens"] for s in shards),
        "fp8_rel_rms_error": (sq_err / sq_ref) ** 0.5 if header["hidden_dtype"] == "fp8" and sq_ref else None,
        "shards": shards,
    }
    if manifest["num_samples"] != header["data"]["num_samples"]:
        raise RuntimeError(
            f"{store_dir}: shards hold {manifest['num_samples']} samples, "
            f"the data has {header['data']['num_samples']}"
        )
    write_json_atomic(store_dir / "manifest.json", manifest)
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading


def shard_problem(path: Path, sha256: str) -> str | None:
    """What is wrong with a journaled shard ("missing", "damaged": not the bytes it was written
    with), or None."""
    if not path.exists():
        return "missing"
    return "damaged" if file_sha256(path) != sha256 else None


def read_verified(path: Path) -> dict:
    """verify()'s record of the shards it hashed; an unreadable one (a crash or a hand edit) is only
    a cache: every shard is hashed again and the record rewritten."""
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (ValueError, OSError):
        return {}
    return cache if isinstance(cache, dict) else {}


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file as zero-copy views of a private memory map. A file cut
    short or with a damaged header (a disk that filled, a copy that stopped) is refused in one line
    naming it, before any view is made."""
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    try:
        (head_len,) = struct.unpack("<Q", raw[:8].numpy().tobytes())
        header = json.loads(raw[8 : 8 + head_len].numpy().tobytes())
        header.pop("__metadata__", None)
        base = 8 + head_len
        ends = [base + info["data_offsets"][1] for info in header.values()]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: damaged safetensors header ({type(e).__name__}: {e}); {REPAIR}") from None
    if max(ends, default=base) > size:
        raise ValueError(f"{path}: {size:,} bytes, its header needs {max(ends):,}: cut short; {REPAIR}")
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = raw[base + begin : base + end].view(_TORCH_DTYPE[info["dtype"]]).reshape(info["shape"])
    return out


class Store:
    """Read side of a finished store: `len`, `lengths`, `sample(i)`, `verify()`, `check_target()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"{manifest_path}: no manifest (precompute has not finished; rerun it)")
        try:
            self.manifest = json.loads(manifest_path.read_text())
            self.manifest["shards"], self.manifest["num_samples"]  # noqa: B018 (the fields every reader needs)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{manifest_path}: damaged ({type(e).__name__}: {e}); {REPAIR}") from None
        self._shard_starts = np.cumsum([0] + [s["samples"] for s in self.manifest["shards"]])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @cached_property
    def _shards(self) -> list[dict[str, torch.Tensor]]:
        # Opened on first use, so that `verify()` can report a shard too damaged to parse.
        return [read_shard(self.path / s["file"]) for s in self.manifest["shards"]]

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens of each sample, in store order."""
        return np.concatenate([np.diff(s["offsets"].numpy()) for s in self._shards])

    @cached_property
    def sample_ids(self) -> np.ndarray:
        """Each sample's position in the data loader's order (store order is by rank and length)."""
        return np.concatenate([s["sample_ids"].numpy() for s in self._shards])

    @property
    def aux_layers(self) -> list[int]:
        """The layers whose entering states the store keeps beside the last layer's (eagle3)."""
        return self.manifest.get("aux_layers", [])

    def most_frequent_tokens(self, n: int, vocab_size: int) -> torch.Tensor:
        """The `n` target ids most often supervised in the store (ties: the lower id), increasing:
        a head's draft vocabulary, as the EAGLE reference and SpecForge choose it."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for shard in self._shards:
            counts += torch.bincount(
                shard["input_ids"][shard["loss_mask"].bool()].long(), minlength=vocab_size
            )
        return torch.sort(-counts, stable=True).indices[:n].sort().values

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids LongTensor [n], loss_mask BoolTensor [n], hidden bf16 [n, L·H]) of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)}")
        shard_index = int(np.searchsorted(self._shard_starts, i, side="right")) - 1
        shard, k = self._shards[shard_index], i - int(self._shard_starts[shard_index])
        a, b = int(shard["offsets"][k]), int(shard["offsets"][k + 1])
        hidden = shard["hidden"][a:b]
        if "hidden_scale" in shard:
            hidden = dequantize_fp8(hidden, shard["hidden_scale"][a:b])
        return shard["input_ids"][a:b].long(), shard["loss_mask"][a:b].bool(), hidden

    def verify(self, full: bool = False, say=None) -> None:
        """Check the manifest's counts against its shards and every shard's sha256; raise naming the
        first damaged shard and how to repair it. Unless `full`, a shard whose size and modification
        time are those it had when it last hashed right is not hashed again (`verified.json`), so a
        training run pays the hashing once per store, not once per start; a corruption that keeps
        size and time (bit rot, a tool that restores mtimes) is then found only by a `full` check.
        say: where to report the hashing before it starts (it reads every stale shard whole:
        minutes for a store of hundreds of GB)."""
        shards = self.manifest["shards"]
        problem = self.manifest_problem()
        if problem:
            raise ValueError(f"store {self.path}: {problem}: the manifest is damaged; {REPAIR}")
        cache_path = self.path / "verified.json"
        cache = read_verified(cache_path)
        stale = [s for s in shards if full or cache.get(s["file"]) != self._stamp(s)]
        if stale and say is not None:
            size = sum(stamp[0] for stamp in map(self._stamp, stale) if stamp)  # a missing one: 0
            say(
                f"store {self.path}: hashing {len(stale)} of {len(shards)} shards ({size / 1e9:.1f} GB) "
                "against the manifest" + ("" if full else " (once where verified.json can be written)")
            )
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            hashed = pool.map(self._shard_sha, stale)
            found = list(tqdm(hashed, total=len(stale), desc="hashing", unit="shard", disable=say is None))
        for shard, sha in zip(stale, found):
            if sha != shard["sha256"]:
                raise ValueError(
                    f"store {self.path}: shard {shard['file']} is corrupted (sha256 {sha[:16]}…, manifest "
                    f"says {shard['sha256'][:16]}…); {REPAIR}"
                )
            cache[shard["file"]] = self._stamp(shard)
        if stale:
            try:
                write_json_atomic(cache_path, cache)
            except OSError:  # a read-only store: verified again next time
                pass

    def manifest_problem(self) -> str | None:
        """How manifest.json disagrees with the run's own records, or None: its counts against its
        shards, against the samples the run precomputed (`run.json`), and its shards against those
        the ranks' journals committed (a shard entry deleted from the manifest, with the counts
        edited to match, would otherwise train on part of the data unnoticed)."""
        shards = self.manifest["shards"]
        held = sum(s["samples"] for s in shards)
        if held != self.manifest["num_samples"]:
            return f"manifest.json lists shards holding {held} samples but says num_samples {self.manifest['num_samples']}"
        run = self.path / "run.json"
        if run.exists():
            expected = json.loads(run.read_text())["data"]["num_samples"]
            if held != expected:
                return f"manifest.json lists {held} samples, the run precomputed {expected} (run.json)"
        listed = {s["file"] for s in shards}
        for path in sorted(self.path.glob("journal-*.jsonl")):
            lost = [e["file"] for e in Journal(path).read() if e["file"] not in listed]
            if lost:
                return f"{path.name} committed {lost[0]}, which manifest.json does not list"
        return None

    def _stamp(self, shard: dict) -> list:
        """What a verified shard looks like on disk: size, modification time, the manifest's sha256."""
        try:
            st = (self.path / shard["file"]).stat()
        except FileNotFoundError:
            return []
        return [st.st_size, st.st_mtime_ns, shard["sha256"]]

    def _shard_sha(self, shard: dict) -> str:
        path = self.path / shard["file"]
        return file_sha256(path) if path.exists() else "missing"

    def check_target(self, identity: dict) -> None:
        """Raise ValueError if this store was made with another target, tokenizer or chat template."""
        check_same_target(identity, self.manifest["target"], f"store {self.path}")


REPAIR = "repair with `python -m mtp_train.store repair STORE_DIR`, then rerun precompute (it redoes only the damaged shards' samples)"


def repair(store_dir: str | Path) -> list[str]:
    """Drop every damaged or missing shard from the store's records, so that rerunning precompute
    recomputes exactly their samples: the shard file, its journal line and the rank and store
    manifests go (the journal is what a resumed precompute trusts). Returns the dropped files."""
    store_dir = Path(store_dir)
    try:
        store = Store(store_dir)
        problem = store.manifest_problem()
    except ValueError:
        problem = "unreadable"
    if problem:  # a damaged manifest.json: precompute merges it again from the ranks' records
        for path in (store_dir / "manifest.json", store_dir / "verified.json"):
            path.unlink(missing_ok=True)
        return ["manifest.json"]
    manifest = store.manifest
    damaged = [s["file"] for s in manifest["shards"] if store._shard_sha(s) != s["sha256"]]
    for path in store_dir.glob("journal-*.jsonl"):
        journal = Journal(path)
        entries = journal.read()
        kept = [e for e in entries if e["file"] not in damaged]
        if len(kept) != len(entries):
            journal.rewrite(kept)
    for name in damaged:
        (store_dir / name).unlink(missing_ok=True)
    if damaged:
        for path in [
            *store_dir.glob("rank-*.json"),
            store_dir / "manifest.json",
            store_dir / "verified.json",
        ]:
            path.unlink(missing_ok=True)
    return damaged


@one_line_errors
def main(argv: list[str]) -> None:
    """`python -m mtp_train.store verify|repair STORE_DIR [--cached]`."""
    cached = "--cached" in argv
    argv = [a for a in argv if a != "--cached"]
    if len(argv) != 2 or argv[0] not in ("verify", "repair"):
        raise SystemExit(USAGE)
    if not (Path(argv[1]) / "manifest.json").is_file():
        raise FileNotFoundError(
            f"{argv[1]}/manifest.json: no store manifest there (is it a store directory?)"
        )
    if argv[0] == "verify":
        Store(argv[1]).verify(full=not cached, say=lambda line: print(line, flush=True))
        print(
            f"{argv[1]}: every shard intact"
            + (" (cached hashes trusted)" if cached else " (every shard re-hashed)")
        )
        return
    dropped = repair(argv[1])
    print(
        f"{argv[1]}: dropped {dropped or 'nothing'}; rerun precompute to recompute them"
        if dropped
        else f"{argv[1]}: nothing damaged"
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
