"""The store's format: round trips (bf16, fp8), crash recovery of the writer, corruption, target checks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from mtp_train.store import (
    Journal,
    Record,
    ShardWriter,
    Store,
    bytes_per_token,
    dequantize_fp8,
    merge_manifests,
    quantize_fp8,
    read_shard,
    repair,
    shard_name,
)
from mtp_train.target_files import target_identity, write_random_target

H = 16
IDENTITY = {"path": "/t", "config_hash": "c", "tokenizer_hash": "t", "chat_template_hash": "j"}


def make_records(n: int, seed: int = 0) -> list[Record]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        out.append(
            Record(
                sample_id=k,
                input_ids=torch.randint(0, 50_000, (length,), generator=g),
                loss_mask=torch.rand(length, generator=g) < 0.5,
                hidden=(torch.randn(length, H, generator=g) * 3).to(torch.bfloat16),
            )
        )
    return out


def header(num_samples: int, world: int = 1, hidden_dtype: str = "bf16", identity=IDENTITY) -> dict:
    return {
        "format": "mtp-train-store",
        "version": 1,
        "target": identity,
        "hidden_size": H,
        "hidden_dtype": hidden_dtype,
        "bytes_per_token": bytes_per_token(H, hidden_dtype),
        "world_size": world,
        "data": {"num_samples": num_samples},
    }


def write_store(path, records, shard_tokens=64, hidden_dtype="bf16", identity=IDENTITY) -> Store:
    writer = ShardWriter(path, rank=0, shard_tokens=shard_tokens, hidden_dtype=hidden_dtype)
    for r in records:
        writer.add(r)
    writer.finish()
    merge_manifests(path, header(len(records), hidden_dtype=hidden_dtype, identity=identity))
    return Store(path)


def test_bytes_per_token():
    assert bytes_per_token(4096, "bf16") == 2 * 4096 + 5
    assert bytes_per_token(4096, "fp8") == 4096 + 9
    with pytest.raises(ValueError, match="hidden_dtype"):
        bytes_per_token(4096, "fp16")


def test_round_trip_bf16(tmp_path):
    records = make_records(20)
    store = write_store(tmp_path, records)
    shards = store.manifest["shards"]
    assert len(shards) > 3, "small shard_tokens should give several shards"
    # Shards close at the first sample boundary past shard_tokens: all but the last reach it.
    assert all(s["tokens"] >= 64 for s in shards[:-1])
    assert len(store) == 20 and store.manifest["num_tokens"] == sum(r.tokens for r in records)
    assert store.lengths.tolist() == [r.tokens for r in records]
    assert store.sample_ids.tolist() == list(range(20))
    for i, r in enumerate(records):
        ids, mask, hidden = store.sample(i)
        assert ids.dtype == torch.long and mask.dtype == torch.bool and hidden.dtype == torch.bfloat16
        assert torch.equal(ids, r.input_ids) and torch.equal(mask, r.loss_mask)
        assert torch.equal(hidden, r.hidden)
    assert store.manifest["fp8_rel_rms_error"] is None
    store.verify()
    with pytest.raises(IndexError):
        store.sample(20)


def test_shards_are_plain_safetensors(tmp_path):
    """Files written by the streaming writer open with the safetensors library itself."""
    records = make_records(5)
    store = write_store(tmp_path, records, shard_tokens=10_000)
    with safe_open(tmp_path / store.manifest["shards"][0]["file"], "pt") as f:
        assert set(f.keys()) == {"offsets", "sample_ids", "input_ids", "loss_mask", "hidden"}
        offsets = f.get_tensor("offsets")
        assert f.get_tensor("input_ids").dtype == torch.int32
        assert f.get_tensor("loss_mask").dtype == torch.uint8
        hidden = f.get_tensor("hidden")
    assert offsets.tolist() == [0, *torch.tensor([r.tokens for r in records]).cumsum(0).tolist()]
    assert torch.equal(hidden, torch.cat([r.hidden for r in records]))


def test_fp8_round_trip_and_error(tmp_path):
    bf16 = make_records(12)
    fp8 = []
    for r in bf16:
        q, scale = quantize_fp8(r.hidden)
        err = dequantize_fp8(q, scale).float() - r.hidden.float()
        sq_err, sq_ref = float(err.pow(2).sum()), float(r.hidden.float().pow(2).sum())
        fp8.append(Record(r.sample_id, r.input_ids, r.loss_mask, q, scale, sq_err, sq_ref))
    store = write_store(tmp_path, fp8, hidden_dtype="fp8")
    ref = torch.cat([r.hidden.float() for r in bf16])
    got = torch.cat([store.sample(i)[2].float() for i in range(len(store))])
    rel_rms = float((got - ref).pow(2).sum().sqrt() / ref.pow(2).sum().sqrt())
    print(f"fp8 e4m3 relative RMS error vs bf16: {rel_rms:.4f}")
    # e4m3 keeps 3 mantissa bits: a relative rounding error of ≤ 2^-4 per element, ~2-3% RMS.
    assert 0 < rel_rms < 0.04
    assert store.manifest["fp8_rel_rms_error"] == pytest.approx(rel_rms, rel=1e-3)
    assert store.sample(0)[2].dtype == torch.bfloat16


def test_fp8_extremes():
    h = torch.tensor([[0.0, 0.0], [1e4, -3.0], [1e-8, 2e-8]])
    q, scale = quantize_fp8(h)
    back = dequantize_fp8(q, scale).float()
    assert torch.isfinite(back).all()
    assert back[0].eq(0).all() and back[1, 0] == pytest.approx(1e4, rel=0.07)
    assert back[2, 1] == pytest.approx(2e-8, rel=0.07)


def test_writer_resumes_from_journal(tmp_path):
    """A crash leaves: journaled shards, an unjournaled shard (renamed just before the crash), a
    .tmp, a torn journal line. Reopening keeps the first, drops the rest, and writing the samples
    not yet done gives every sample exactly once."""
    records = make_records(30)
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=64)
    for r in records[:12]:
        writer.add(r)
    writer.wait()
    committed = len(writer.shards)
    assert committed >= 2 and writer.next_index == committed
    (tmp_path / shard_name(0, committed)).write_bytes(b"in flight")
    (tmp_path / (shard_name(0, committed + 1) + ".tmp")).write_bytes(b"partial")
    with open(writer.journal.path, "a") as f:
        f.write('{"file": "shard-00000-0')  # torn by the crash

    writer = ShardWriter(tmp_path, rank=0, shard_tokens=64)
    assert len(writer.shards) == committed
    assert not (tmp_path / shard_name(0, committed)).exists()
    assert not list(tmp_path.glob("*.tmp"))
    done = writer.done_ids()
    assert done == set(range(sum(e["samples"] for e in writer.shards)))
    for r in records:
        if r.sample_id not in done:
            writer.add(r)
    writer.finish()
    merge_manifests(tmp_path, header(30))
    store = Store(tmp_path)
    assert sorted(store.sample_ids.tolist()) == list(range(30))
    by_id = dict(zip(store.sample_ids.tolist(), range(len(store))))
    for r in records:
        assert torch.equal(store.sample(by_id[r.sample_id])[2], r.hidden)


def test_resume_continues_past_a_gap_in_the_journal(tmp_path):
    """Shards commit in parallel, so a crash can leave shard 2 journaled and shard 1 not."""
    records = make_records(12)
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=40)
    for r in records:
        writer.add(r)
    writer.wait()
    entries = writer.journal.read()
    assert len(entries) >= 3
    lost = entries[1]
    writer.journal.path.write_text("".join(json.dumps(e) + "\n" for e in entries if e is not lost))

    writer = ShardWriter(tmp_path, rank=0, shard_tokens=40)
    assert not (tmp_path / lost["file"]).exists()
    assert writer.next_index == max(e["index"] for e in entries) + 1
    done = writer.done_ids()
    for r in records:
        if r.sample_id not in done:
            writer.add(r)
    writer.finish()
    merge_manifests(tmp_path, header(12))
    assert sorted(Store(tmp_path).sample_ids.tolist()) == list(range(12))


def journal_entry(index: int) -> dict:
    return {"file": shard_name(0, index), "rank": 0, "index": index, "sha256": f"{index:064x}"}


def test_journal_drops_only_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path / "j.jsonl")
    journal.append(journal_entry(1))
    journal.append(journal_entry(2))
    with open(journal.path, "a") as f:
        f.write('{"file": 3')
    assert journal.read() == [journal_entry(1), journal_entry(2)]
    journal.append(journal_entry(4))
    assert journal.read() == [journal_entry(1), journal_entry(2), journal_entry(4)]


def test_a_damaged_journal_line_is_refused_before_anything_is_deleted(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    for r in make_records(3):
        writer.add(r)
    writer.wait()
    lines = writer.journal.path.read_text().splitlines()
    # shards commit in parallel: shard 0's line may be any of them
    at = next(i for i, line in enumerate(lines) if shard_name(0, 0) in line)
    lines[at] = lines[at].replace(shard_name(0, 0), shard_name(0, 7))  # garbled: file and index disagree
    writer.journal.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"journal-00000.jsonl:{at + 1}: damaged journal line"):
        ShardWriter(tmp_path, rank=0, shard_tokens=10)
    assert (tmp_path / shard_name(0, 0)).exists()  # the genuine shard is still there


def test_a_resumed_rank_recomputes_a_shard_damaged_since_it_was_journaled(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    records = make_records(3)
    for r in records:
        writer.add(r)
    writer.wait()
    victim = tmp_path / shard_name(0, 0)
    lost = {int(i) for i in read_shard(victim)["sample_ids"]}
    data = bytearray(victim.read_bytes())
    data[-4:] = bytes(4)
    victim.write_bytes(bytes(data))
    resumed = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    assert shard_name(0, 0) not in {e["file"] for e in resumed.shards} and not victim.exists()
    assert resumed.done_ids() == {r.sample_id for r in records} - lost


def test_a_resumed_rank_recomputes_a_journaled_shard_deleted_since(tmp_path, capsys):
    """As a damaged one: before, the rank refused and `repair` (which needs a manifest) could not help."""
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    records = make_records(3)
    for r in records:
        writer.add(r)
    writer.wait()
    victim = tmp_path / shard_name(0, 0)
    lost = {int(i) for i in read_shard(victim)["sample_ids"]}
    victim.unlink()
    resumed = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    assert shard_name(0, 0) not in {e["file"] for e in resumed.shards}
    assert shard_name(0, 0) not in resumed.journal.path.read_text()
    assert resumed.done_ids() == {r.sample_id for r in records} - lost
    assert f"{shard_name(0, 0)} is missing; its samples are computed again" in capsys.readouterr().out


def test_merge_two_ranks_and_refuse_missing_rank(tmp_path):
    records = make_records(10)
    for rank in (0, 1):
        writer = ShardWriter(tmp_path, rank=rank, shard_tokens=30)
        for r in records[rank::2]:
            writer.add(r)
        if rank == 0:
            writer.finish()
    with pytest.raises(FileNotFoundError, match="rank 1 has not finished"):
        merge_manifests(tmp_path, header(10, world=2))
    writer.finish()
    merge_manifests(tmp_path, header(10, world=2))
    store = Store(tmp_path)
    assert sorted(store.sample_ids.tolist()) == list(range(10))
    assert {s["rank"] for s in store.manifest["shards"]} == {0, 1}


def test_merge_refuses_a_wrong_sample_count(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=30)
    for r in make_records(4):
        writer.add(r)
    writer.finish()
    with pytest.raises(RuntimeError, match="shards hold 4 samples, the data has 5"):
        merge_manifests(tmp_path, header(5))


def test_verify_detects_a_flipped_byte(tmp_path):
    store = write_store(tmp_path, make_records(20))
    store.verify()
    victim = store.manifest["shards"][2]["file"]
    path = tmp_path / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"shard {victim} is corrupted"):
        Store(tmp_path).verify()


def test_full_verify_finds_a_corruption_that_kept_size_and_mtime(tmp_path):
    """The cached check trusts a shard whose size and mtime it has seen hash right; a full one
    (`python -m mtp_train.store verify`, the CLI's default) re-reads it."""
    store = write_store(tmp_path, make_records(20))
    store.verify()
    victim = store.manifest["shards"][1]["file"]
    path = tmp_path / victim
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    Store(tmp_path).verify()  # cached: not re-read
    with pytest.raises(ValueError, match=f"shard {victim} is corrupted"):
        Store(tmp_path).verify(full=True)


def test_repair_drops_an_unreadable_manifest(tmp_path):
    write_store(tmp_path, make_records(6))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: damaged"):
        Store(tmp_path)
    assert repair(tmp_path) == ["manifest.json"]
    assert not (tmp_path / "manifest.json").exists()


def test_incomplete_store_is_refused(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, shard_tokens=10)
    for r in make_records(3):
        writer.add(r)
    with pytest.raises(FileNotFoundError, match="no manifest"):
        Store(tmp_path)


def test_check_target(tmp_path, tiny_target, smollm2):
    identity = target_identity(tiny_target)
    store = write_store(tmp_path / "store", make_records(3), identity=identity)
    store.check_target(identity)

    other_shape = write_random_target(tmp_path / "other", smollm2, seed=1, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"store .* was made with another target: config_hash"):
        store.check_target(target_identity(other_shape))

    other_template = tmp_path / "template"
    shutil.copytree(tiny_target, other_template)
    (other_template / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="chat_template_hash"):
        store.check_target(target_identity(other_template))

    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["target"] == identity
