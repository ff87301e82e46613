"""The training store written while regenerating (`regenerate.capture`): the target computes the
state of every token of an answer while generating it (the prompt's in the prefill, each new
token's in its decode step), so those states are kept instead of running the target over the
regenerated text again in precompute. The store is exactly the one precompute writes from the
regenerated jsonl (same samples, ids, loss masks, manifest); precompute then finds it complete.

    after each answered turn:  the conversation rendered and tokenized as training does
                               == prompt ids + new ids?   yes: keep the generation's states, plus
                               those of the template's end of turn (one more cached forward)
    after each written batch:  each record → its sample id (its place in `load_samples`' order)
                               → the store's shard writer
    at the end:                samples without kept states (tokenized differently, or in flight at
                               a kill) are forwarded as precompute would; run.json, manifest.json

Until the end the store's `run.json` says it is unfinished, so a precompute run on it refuses to
resume it; a rerun of the regeneration finishes it. Resume: committed shards are checked against
the data (ids and masks), the rest is redone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from inference_ref.generate import States
from inference_ref.target import TargetModel
from mtp_train.config import ConfigError, RunConfig
from mtp_train.data import Conversation, Sample, encode, iter_records, load_samples, training_sample
from mtp_train.precompute import (
    RECORDED_LATER,
    check_finite_states,
    encode_hidden,
    forward_batch,
    pack_by_length,
    run_header,
)
from mtp_train.run import Target, aux_layers_of
from mtp_train.store import Record, ShardWriter, merge_manifests, read_shard, write_json_atomic
from mtp_train.target_files import check_same_target

UNFINISHED = "unfinished: rerun mtp_train.regenerate with regenerate.capture=true to finish this store"
TAIL_ROOM = 8
"""Spare cache slots after an answer, for the template's end of turn (ChatML's `<|im_end|>\\n`: 2)."""


def check_capture(cfg: RunConfig) -> None:
    """The store is the regenerated jsonl's: refuse settings under which it would be another one."""
    files = [Path(f).resolve() for f in cfg.data.train_files]
    if files != [Path(cfg.regenerate.output).resolve()]:
        raise ConfigError(
            f"regenerate.capture writes the store of the regenerated conversations alone: set "
            f"data.train_files=[{cfg.regenerate.output}] (it is {list(cfg.data.train_files)}), or "
            "precompute a store for other data"
        )
    if cfg.model.tp_size != 1:
        raise ConfigError(
            "regenerate.capture runs the target in one process: set model.tp_size=1, or precompute"
        )


class StoreCapture:
    """The store `precompute.store_dir` built from a regeneration's states (see the module)."""

    def __init__(self, cfg: RunConfig, target: Target, compute_dtype: torch.dtype):
        check_capture(cfg)
        self.cfg, self.target, self.compute_dtype = cfg, target, compute_dtype
        self.dir = Path(cfg.precompute.store_dir)
        self.aux = tuple(aux_layers_of(cfg.model, target.config)) if cfg.precompute.aux else ()
        self.kept: dict[str, tuple[list[int], torch.Tensor]] = {}  # prompt id → (tokens, states)
        self.captured = self.forwarded = 0

    def states(self) -> States:
        """What `generate` is asked to keep for this store."""
        return States(self.aux, TAIL_ROOM)

    # --- before the first answer ------------------------------------------------------------

    def open(self, tokenizer) -> None:
        """Take up the store where an earlier run left it; call after the output's torn line is cut."""
        self.tokenizer, data = tokenizer, self.cfg.data
        out = Path(self.cfg.regenerate.output)
        before = load_samples(data, tokenizer)[0] if out.exists() else []
        self.records = sum(1 for _ in iter_records(out)) if out.exists() else 0
        self.next_id = len(before)
        self.writer = ShardWriter(
            self.dir, 0, self.cfg.precompute.shard_tokens, self.cfg.precompute.hidden_dtype
        )
        self._check_settings()
        self._drop_mismatched(before)
        self.stored = self.writer.done_ids()

    def _run_json(self) -> dict | None:
        path = self.dir / "run.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _check_settings(self) -> None:
        old, now = self._run_json(), self._header([], {})
        if old is None:
            return
        check_same_target(now["target"], old["target"], f"store {self.dir}")
        for key in ("hidden_dtype", "compute_dtype", "aux_layers", "target_quantization", "world_size"):
            if old.get(key) != now.get(key) and not ((key,) in RECORDED_LATER and old.get(key) is None):
                raise ValueError(
                    f"store {self.dir} was written with {key} {old.get(key)!r}, this run has "
                    f"{now.get(key)!r}: choose another precompute.store_dir"
                )

    def _drop_mismatched(self, samples: list[Sample]) -> None:
        """Committed shards holding a sample other than the data's of its id (the data settings
        changed since) leave the journal: their samples are stored again."""
        bad = [e for e in self.writer.shards if not self._shard_matches(e["file"], samples)]
        for entry in bad:
            (self.dir / entry["file"]).unlink()
        if bad:
            self.writer.shards = [e for e in self.writer.shards if e not in bad]
            self.writer.journal.rewrite(self.writer.shards)

    def _shard_matches(self, name: str, samples: list[Sample]) -> bool:
        shard = read_shard(self.dir / name)
        bounds = shard["offsets"].tolist()
        for k, a, b in zip(shard["sample_ids"].tolist(), bounds[:-1], bounds[1:]):
            if k >= len(samples) or shard["input_ids"][a:b].tolist() != samples[k].input_ids:
                return False
            if shard["loss_mask"][a:b].tolist() != samples[k].loss_mask:
                return False
        return True

    # --- while answering ----------------------------------------------------------------------

    def keep(self, ids: list[str], dialogs, prompts: list[list[int]], new: list[list[int]], states: States):
        """After a turn: conversation `ids[b]` (its messages so far, `dialogs[b]`) as training
        tokenizes it, and its states where generation computed them for those very tokens: the
        prompt and new tokens it was fed, then the template's end of turn fed now."""
        convs = [Conversation(d, f"capture:{i}", i) for i, d in zip(ids, dialogs)]
        tokens = [s.input_ids for s in encode(self.tokenizer, convs)]
        fed = [p + n[:-1] for p, n in zip(prompts, new)]
        same = [t[: len(f)] == f and len(t) - len(f) <= TAIL_ROOM for f, t in zip(fed, tokens)]
        tails = states.feed([t[len(f) :] if ok else [] for f, t, ok in zip(fed, tokens, same)])
        for b, i in enumerate(ids):
            self.kept.pop(i, None)  # an earlier turn's states no longer cover the conversation
            if same[b]:
                self.kept[i] = (tokens[b], torch.cat([states.row(b, len(fed[b])), tails[b]]).cpu())

    def add(self, records: list[dict]) -> None:
        """The records just written to the output, in order: each one `load_samples` keeps gets the
        next sample id and goes to the store with its kept states (or waits for `finish`)."""
        if records and not self._unfinished():  # a store that grows is unfinished until `finish`
            self._mark_unfinished()
        data = self.cfg.data
        last = None if data.max_samples is None else data.holdout + data.max_samples
        for record in records:
            index, self.records = self.records, self.records + 1
            tokens, states = self.kept.pop(record["id"], (None, None))
            if index < data.holdout or (last is not None and index >= last):
                continue
            conv = Conversation(record["messages"], record["source"], record["id"])
            sample = training_sample(self.tokenizer, conv, data)
            if sample is None:
                continue
            k, self.next_id = self.next_id, self.next_id + 1
            n = len(sample.input_ids)
            if tokens is not None and tokens[:n] == sample.input_ids:
                self.writer.add(self._record(k, sample, states[:n]))
                self.stored.add(k)
                self.captured += 1

    def _record(self, k: int, sample: Sample, states: torch.Tensor) -> Record:
        check_finite_states(torch.isfinite(states).all(-1), sample.source)
        stored, scale, sq_err, sq_ref = encode_hidden(
            states, self.cfg.precompute.hidden_dtype, 1 + len(self.aux)
        )
        fp8 = scale is not None
        return Record(
            k,
            torch.tensor(sample.input_ids, dtype=torch.int32),
            torch.tensor(sample.loss_mask, dtype=torch.uint8),
            stored,
            scale,
            float(sq_err.sum()) if fp8 else 0.0,
            float(sq_ref.sum()) if fp8 else 0.0,
        )

    def _unfinished(self) -> bool:
        old = self._run_json()
        return old is not None and old["data"]["sha256"] == UNFINISHED

    def _mark_unfinished(self) -> None:
        """A precompute run on the store now refuses it (the data differs), naming this module."""
        header = self._header([], {})
        header["data"]["sha256"] = UNFINISHED
        write_json_atomic(self.dir / "run.json", header)
        (self.dir / "manifest.json").unlink(missing_ok=True)

    def _header(self, samples: list[Sample], counts: dict) -> dict:
        """precompute's header of this store (one rank)."""
        return run_header(self.cfg, self.target, samples, counts, 1, self.compute_dtype)

    # --- at the end -----------------------------------------------------------------------------

    def finish(self, load_model: Callable[[], TargetModel]) -> Path:
        """Store what has no kept states with the target (`load_model()`, called only then), and
        publish the store as precompute does (run.json, the rank's shard list, manifest.json)."""
        samples, counts = load_samples(self.cfg.data, self.tokenizer)
        header = self._header(samples, counts)
        if (self.dir / "manifest.json").exists() and self._run_json() == header:
            return self.dir  # a rerun: the store is complete for this data
        todo = [k for k in range(len(samples)) if k not in self.stored]
        if todo:
            self._forward(load_model(), samples, todo)
        self.writer.finish()
        write_json_atomic(self.dir / "run.json", header)
        merge_manifests(self.dir, header)
        print(
            f"store: {len(samples)} samples in {self.dir}: {self.captured} with the states kept from "
            f"generation, {self.forwarded} forwarded again (tokenized otherwise than generated, or "
            "answered before a restart)"
        )
        return self.dir

    @torch.inference_mode()
    def _forward(self, model: TargetModel, samples: list[Sample], todo: list[int]) -> None:
        lengths = {k: len(samples[k].input_ids) for k in todo}
        hidden_dtype, budget = self.cfg.precompute.hidden_dtype, self.cfg.precompute.tokens_per_batch
        # answers written before a restart (or a store deleted since): the target reads them again,
        # which takes minutes on a CPU; say so as it goes
        with tqdm(
            total=len(todo), unit="sample", desc="store: forwarding answers without kept states"
        ) as bar:
            for ids in pack_by_length(todo, lengths, budget):
                for record in forward_batch(model, samples, ids, hidden_dtype, self.aux).records():
                    self.writer.add(record)
                bar.update(len(ids))
        self.stored.update(todo)
        self.forwarded += len(todo)
