"""Precompute end to end on the tiny CPU target: contents, crash + resume, ranks, fp8, disk check."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models.llama import load_llama
from mtp_train.config import RunConfig
from mtp_train.data import load_samples
from mtp_train.parallel import Ranks
from mtp_train.precompute import DiskFull, pack_by_length, precompute_rank, prepare, run_precompute
from mtp_train.store import Store, merge_manifests

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven tired wizards brew strange potions".split()
NUM_RECORDS = 16
# Data-parallel ranks 0 and 1 of 2, without tensor parallelism, run here one after the other.
CPU_RANK0, CPU_RANK1 = (Ranks(r, 2, 0, 1, torch.device("cpu")) for r in (0, 1))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Conversations of varied lengths (about 40 to 130 tokens rendered)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with path.open("w") as f:
        for i in range(NUM_RECORDS):
            user = " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))
            answer = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
    return path


def make_cfg(target: Path, chat_file: Path, store_dir: Path, **precompute):
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.name = "tiny"
    cfg.model.target = str(target)
    cfg.data.train_files = [str(chat_file)]
    cfg.precompute.store_dir = str(store_dir)
    # Small shards and batches, so that 16 samples make several of each.
    cfg.precompute.shard_tokens = 200
    cfg.precompute.tokens_per_batch = 256
    for key, value in precompute.items():
        cfg.precompute[key] = value
    return cfg


@pytest.fixture(scope="module")
def reference(tiny_target, chat_file, tmp_path_factory) -> Store:
    """An uninterrupted single-process run."""
    store_dir = tmp_path_factory.mktemp("reference") / "store"
    return Store(run_precompute(make_cfg(tiny_target, chat_file, store_dir)))


def by_sample_id(store: Store) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    ids = store.sample_ids.tolist()
    assert sorted(ids) == list(range(NUM_RECORDS)), "every sample exactly once"
    return {k: store.sample(i) for i, k in enumerate(ids)}


def assert_same_store(a: Store, b: Store) -> None:
    """Same samples; hidden states equal up to bf16 rounding (batches may be packed differently,
    and a last-bit difference in fp32 can round to a neighbouring bf16; here they are bit-identical)."""
    sa, sb = by_sample_id(a), by_sample_id(b)
    for k in sa:
        (ids_a, mask_a, h_a), (ids_b, mask_b, h_b) = sa[k], sb[k]
        assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b)
        torch.testing.assert_close(h_a, h_b, rtol=1e-2, atol=1e-3)


def test_pack_by_length():
    lengths = {0: 5, 1: 50, 2: 20, 3: 30, 4: 200, 5: 20}
    batches = pack_by_length(list(lengths), lengths, budget=60)
    assert batches == [[4], [1], [3, 2], [5, 0]]  # longest first; an over-budget sample alone
    assert sorted(k for b in batches for k in b) == sorted(lengths)


def test_store_matches_target_run_alone(reference, tiny_target, chat_file):
    """Each stored sample: the loader's tokens and mask, and the hidden states of the target
    running that sample by itself (packing must not leak across samples)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    samples, _ = load_samples(make_cfg(tiny_target, chat_file, Path("unused")).data, tokenizer)
    model = load_llama(tiny_target, "cpu", torch.float32)
    manifest = reference.manifest
    assert len(manifest["shards"]) > 2 and manifest["num_samples"] == NUM_RECORDS
    assert manifest["hidden_size"] == 64 and manifest["bytes_per_token"] == 2 * 64 + 5
    assert manifest["num_tokens"] == sum(len(s.input_ids) for s in samples)
    for k, (ids, mask, hidden) in by_sample_id(reference).items():
        assert ids.tolist() == samples[k].input_ids
        assert mask.tolist() == [bool(m) for m in samples[k].loss_mask]
        alone, _ = model.forward_packed(ids, cu_seqlens_of([len(ids)]))
        torch.testing.assert_close(hidden, alone.to(torch.bfloat16), rtol=1e-2, atol=1e-3)
    reference.verify()


def test_rerun_of_a_finished_store_does_nothing(reference, tiny_target, chat_file, capsys):
    before = (reference.path / "manifest.json").read_bytes()
    run_precompute(make_cfg(tiny_target, chat_file, reference.path))
    assert "already complete" in capsys.readouterr().out
    assert (reference.path / "manifest.json").read_bytes() == before


# A real process, stalled inside the 2nd shard's journal append (just before or just after the
# line is written) and then SIGKILLed: the worst moments for "none lost, none twice".
CRASHING_RUN = """
import os, pathlib, sys, time
from omegaconf import OmegaConf
from mtp_train import store
from mtp_train.precompute import run_precompute

append, calls = store.Journal.append, []

def stalling_append(journal, entry):
    calls.append(entry)
    if len(calls) == 2 and os.environ["STALL"] == "after":
        append(journal, entry)
    if len(calls) == 2:
        pathlib.Path(os.environ["MARKER"]).touch()
        time.sleep(600)
    append(journal, entry)

store.Journal.append = stalling_append
run_precompute(OmegaConf.load(sys.argv[1]))
"""


def run_and_kill(cfg, tmp_path: Path, stall: str) -> None:
    (tmp_path / "crash.py").write_text(CRASHING_RUN)
    OmegaConf.save(cfg, tmp_path / "cfg.yaml")
    marker = tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STALL": stall, "MARKER": str(marker)}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(tmp_path / "crash.py"), str(tmp_path / "cfg.yaml")],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 60
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        stalled = marker.exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert stalled, (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize("stall", ["before", "after"])
def test_killed_run_resumes_without_loss_or_duplicates(reference, tiny_target, chat_file, tmp_path, stall):
    store_dir = tmp_path / "store"
    cfg = make_cfg(tiny_target, chat_file, store_dir)
    run_and_kill(cfg, tmp_path, stall)

    assert not (store_dir / "manifest.json").exists()
    journaled = [json.loads(line)["file"] for line in (store_dir / "journal-00000.jsonl").open()]
    assert len(journaled) == (1 if stall == "before" else 2)
    if stall == "before":  # a shard renamed into place but never journaled: its samples must be redone
        assert set(p.name for p in store_dir.glob("shard-*.safetensors")) - set(journaled)

    resumed = Store(run_precompute(cfg))
    resumed.verify()
    assert_same_store(resumed, reference)


def test_two_ranks_each_take_a_disjoint_share(reference, tiny_target, chat_file, tmp_path):
    """Ranks 0 and 1 of a world of 2 (run one after the other), then the merge on rank 0."""
    store_dir = tmp_path / "store"
    cfg = make_cfg(tiny_target, chat_file, store_dir)
    job0 = prepare(cfg, rank=0, world=2)
    precompute_rank(job0, CPU_RANK0)

    # Rank 1 has not run: the store cannot be merged, nor resumed by a different number of processes.
    with pytest.raises(FileNotFoundError, match="rank 1 has not finished"):
        merge_manifests(store_dir, job0.header)
    with pytest.raises(ValueError, match="world_size 2, this run has 1"):
        run_precompute(cfg)

    precompute_rank(prepare(cfg, rank=1, world=2), CPU_RANK1)
    merge_manifests(store_dir, job0.header)
    store = Store(store_dir)
    assert_same_store(store, reference)
    assert {s["rank"] for s in store.manifest["shards"]} == {0, 1}
    first = 0
    for shard in store.manifest["shards"]:
        assert shard["file"].startswith(f"shard-{shard['rank']:05d}-")
        ids = store.sample_ids[first : first + shard["samples"]]
        assert all(k % 2 == shard["rank"] for k in ids), "sample k goes to rank k % 2"
        first += shard["samples"]
    run_precompute(cfg)  # finished: a single process may rerun it (a no-op)


def test_command_line_with_two_processes(reference, tiny_target, chat_file, tmp_path):
    """`torchrun … -m mtp_train.precompute` with Hydra overrides: two real processes (gloo on CPU)
    each write their own shards, rank 0 merges."""
    overrides = [
        "model=tiny_random",
        f"model.target={tiny_target}",
        f"data.train_files=[{chat_file}]",
        f"run_dir={tmp_path}",
        "precompute.shard_tokens=200",
        "precompute.tokens_per_batch=256",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = subprocess.run(
        [*torchrun, "-m", "mtp_train.precompute", *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    store = Store(tmp_path / "store")  # precompute.store_dir defaults to ${run_dir}/store
    assert store.manifest["world_size"] == 2
    assert {s["rank"] for s in store.manifest["shards"]} == {0, 1}
    assert_same_store(store, reference)


def test_command_line_with_tensor_parallel_groups(reference, tiny_target, chat_file, tmp_path):
    """`model.tp_size=2` over 4 processes (two data-parallel groups splitting the data, each target
    sharded two ways; one group alone is the case of test_online's and test_tensor_parallel's
    two-process runs): every rank forwards, each group's leader writes its shards; the store is
    the single-process one."""
    processes = 4
    overrides = [
        "model=tiny_random",
        f"model.target={tiny_target}",
        "model.tp_size=2",
        "model.dtype=float32",
        f"data.train_files=[{chat_file}]",
        f"run_dir={tmp_path}",
        "precompute.shard_tokens=200",
        "precompute.tokens_per_batch=256",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
    ]
    out = subprocess.run(
        [*torchrun, "-m", "mtp_train.precompute", *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    store = Store(tmp_path / "store")
    groups = processes // 2
    assert store.manifest["world_size"] == groups
    assert {s["rank"] for s in store.manifest["shards"]} == set(range(groups))
    assert_same_store(store, reference)


def test_fp8_store(reference, tiny_target, chat_file, tmp_path):
    store = Store(run_precompute(make_cfg(tiny_target, chat_file, tmp_path / "store", hidden_dtype="fp8")))
    assert store.manifest["bytes_per_token"] == 64 + 9
    bf16, fp8 = by_sample_id(reference), by_sample_id(store)
    ref = torch.cat([bf16[k][2].float() for k in bf16])
    got = torch.cat([fp8[k][2].float() for k in bf16])
    rel_rms = float((got - ref).pow(2).sum().sqrt() / ref.pow(2).sum().sqrt())
    print(f"fp8 e4m3 store: relative RMS error vs bf16 {rel_rms:.4f}")
    assert store.manifest["fp8_rel_rms_error"] == pytest.approx(rel_rms, rel=1e-3)
    assert 0 < rel_rms < 0.04
    for k in bf16:
        assert torch.equal(bf16[k][0], fp8[k][0]) and torch.equal(bf16[k][1], fp8[k][1])
    shard_bytes = sum(s["bytes"] for s in store.manifest["shards"])
    assert shard_bytes < 0.6 * sum(s["bytes"] for s in reference.manifest["shards"])


def states_error(store: Store, reference: Store) -> float:
    """Relative RMS error of a store's last-layer states against the reference store's."""
    ref, got = by_sample_id(reference), by_sample_id(store)
    a = torch.cat([ref[k][2].float() for k in ref])
    b = torch.cat([got[k][2].float() for k in ref])
    return float((b - a).pow(2).sum().sqrt() / a.pow(2).sum().sqrt())


def test_a_static_fp8_target_is_calibrated_then_stores_close_states(
    reference, tiny_target, chat_file, tmp_path
):
    """model.quantization=fp8_static: the scales are calibrated on the data's first batch before
    anything is stored (an uncalibrated map would refuse to run), the states stay within FP8's
    error of the unquantized target's, and a second run (or a resumed one) gets the same scales."""
    stores = []
    for run in ("a", "b"):
        cfg = make_cfg(tiny_target, chat_file, tmp_path / run)
        cfg.model.quantization = "fp8_static"
        stores.append(Store(run_precompute(cfg)))
    assert stores[0].manifest["target_quantization"] == "fp8_static"
    per_token = make_cfg(tiny_target, chat_file, tmp_path / "per_token")
    per_token.model.quantization = "fp8"
    error, per_token_error = (
        states_error(stores[0], reference),
        states_error(Store(run_precompute(per_token)), reference),
    )
    print(f"FP8 target states against the unquantized: static {error:.4f}, per token {per_token_error:.4f}")
    assert 0 < error < 2 * per_token_error
    assert states_error(stores[1], stores[0]) == 0


def test_refuses_to_start_without_disk_space(tiny_target, chat_file, tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 5000, 5000))
    cfg = make_cfg(tiny_target, chat_file, tmp_path / "store")
    with pytest.raises(DiskFull, match=r"not enough disk .* needs .* KiB more .* only 4\.9 KiB is free"):
        run_precompute(cfg)
    assert "store estimate" in capsys.readouterr().out
    assert not list((tmp_path / "store").glob("shard-*"))


def test_resume_refuses_other_settings(tiny_target, chat_file, smollm2, tmp_path):
    cfg = make_cfg(tiny_target, chat_file, tmp_path / "store")
    prepare(cfg, rank=0, world=1)  # claims the directory
    with pytest.raises(ValueError, match="hidden_dtype 'bf16', this run has 'fp8'"):
        prepare(make_cfg(tiny_target, chat_file, tmp_path / "store", hidden_dtype="fp8"), 0, 1)
    cfg.data.max_samples = 5
    with pytest.raises(ValueError, match="data.sha256"):
        prepare(cfg, 0, 1)


def test_resume_refuses_another_compute_dtype_and_takes_stores_that_predate_it(
    tiny_target, chat_file, tmp_path
):
    """model.dtype resolved where the forwards run (auto: bf16 on a GPU, fp32 on most CPUs) is in
    the header: a store started in fp32 and resumed in bf16 would hold states rounded two ways."""
    cfg = make_cfg(tiny_target, chat_file, tmp_path / "store")
    cfg.model.dtype = "float32"
    assert prepare(cfg, 0, 1).header["compute_dtype"] == "float32"
    cfg.model.dtype = "bfloat16"
    with pytest.raises(ValueError, match="compute_dtype 'float32', this run has 'bfloat16'"):
        prepare(cfg, 0, 1)
    run_json = tmp_path / "store" / "run.json"
    old = json.loads(run_json.read_text())
    del old["compute_dtype"]  # a store started before the dtype was recorded
    run_json.write_text(json.dumps(old))
    assert prepare(cfg, 0, 1).model_dtype == "bfloat16"
