"""The trainer: learning on a real store, exact resume after a kill, several processes, bad config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from mtp_train.precompute import run_precompute
from mtp_train.target_files import write_random_target
from mtp_train.train import train
from mtp_train.validate.parity import holdout_samples
from tiny import assert_tau_consistent, recipe

GSM8K = Path(__file__).parent / "data" / "gsm8k_64.jsonl"


def metrics(run: Path) -> dict[int, dict]:
    """step → the last logged figures for it (a resumed run logs its steps again)."""
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def validations(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "val/loss" in r}


def tiny_overrides(target: Path, run: Path, store: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",  # exact comparisons below
        f"run_dir={run}",
        f"train.store_dir={store}",
        "train.tokens_per_micro_batch=512",
        "logging.log_every=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def tiny_store(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("tiny_run")
    cfg = recipe(
        ["model=tiny_random", f"model.target={tiny_target}", f"run_dir={run}", f"data.train_files=[{GSM8K}]"]
    )
    return run_precompute(cfg)


def test_training_on_smollm2_lowers_loss_and_raises_top1(smollm2, tmp_path):
    overrides = [
        "model=smollm2_135m",
        f"run_dir={tmp_path}",
        f"data.train_files=[{GSM8K}]",
        "data.max_samples=40",
        "data.max_seq_len=192",
        "train.steps=24",
        "train.tokens_per_micro_batch=384",
        "train.warmup_steps=4",
        "train.lr=3e-3",
        "train.save_every=0",
        "logging.log_every=1",
    ]
    cfg = recipe(overrides)
    run_precompute(cfg)
    train(cfg)
    m = metrics(tmp_path)
    first = sum(m[s]["ce"] for s in (1, 2, 3)) / 3
    last = sum(m[s]["ce"] for s in (22, 23, 24)) / 3
    assert last < first - 0.5, (first, last)
    assert sum(m[s]["top1"] for s in (22, 23, 24)) / 3 > sum(m[s]["top1"] for s in (1, 2, 3)) / 3 + 0.1
    assert all(0 <= row["data_wait_share"] < 1 for row in m.values())


def test_kill_and_resume_reproduces_the_uninterrupted_curve(tiny_target, tiny_store, tmp_path):
    steps = ["train.steps=10", "train.save_every=4"]
    whole = tmp_path / "whole"
    train(recipe(tiny_overrides(tiny_target, whole, tiny_store, *steps)))

    killed = tmp_path / "killed"
    args = tiny_overrides(tiny_target, killed, tiny_store, *steps)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtp_train.train", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpt = killed / "train" / "ckpt-0000004"
    deadline = time.time() + 240
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists() and not (killed / "train" / "ckpt-0000010").exists()

    train(recipe(args))  # resumes from ckpt-0000004
    a, b = metrics(whole), metrics(killed)
    assert sorted(b) == list(range(1, 11))
    for step in range(1, 11):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-6, abs=1e-7), step
        assert b[step]["lr"] == pytest.approx(a[step]["lr"], rel=1e-9), step


def test_two_processes_match_one_at_the_same_global_batch(tiny_target, tiny_store, tmp_path):
    mt_bench = Path(__file__).resolve().parent.parent / "data" / "mt_bench.jsonl"
    # Validation inside the job too: each process takes every other prompt, the sums are added.
    validation = [
        "train.validate_every=2",
        "train.spec_validate_at=[4]",
        f"validate.eval_files=[{mt_bench}]",
        "validate.num_prompts=5",  # split 3 + 2
        "validate.max_new_tokens=8",
        "validate.chain_lengths=[2]",
        "validate.teacher_forced_samples=3",  # prompts 0, 1, 2 whatever the split
    ]
    common = ["train.steps=4", "train.save_every=0", *validation]
    one = tmp_path / "one"
    train(recipe(tiny_overrides(tiny_target, one, tiny_store, *common, "train.grad_accum=2")))
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "mtp_train.train"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd + tiny_overrides(tiny_target, two, tiny_store, *common),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = metrics(one), metrics(two)
    for step in range(1, 5):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["top1"] == pytest.approx(a[step]["top1"], abs=1e-6), step
    val_a, val_b = validations(one), validations(two)
    assert sorted(val_b) == [2, 4]
    for step in (2, 4):
        assert val_b[step]["val/loss"] == pytest.approx(val_a[step]["val/loss"], rel=1e-4), step
    assert val_b[4]["val/tau_k2"] == pytest.approx(val_a[4]["val/tau_k2"], rel=1e-3)
    # both processes' validation times are gathered (min from one, max from the other)
    assert 0 < val_b[4]["val/seconds_min"] <= val_b[4]["val/seconds_max"]


def test_unknown_config_keys_are_errors(tiny_target):
    with pytest.raises(ConfigCompositionException, match="lerning_rate"):
        recipe(["model=tiny_random", f"model.target={tiny_target}", "train.lerning_rate=1"])
    done = subprocess.run(
        [sys.executable, "-m", "mtp_train.train", "model=tiny_random", "train.bogus_key=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "bogus_key" in done.stderr


def test_a_store_of_another_target_is_refused(smollm2, tiny_store, tmp_path):
    other = write_random_target(tmp_path / "other", smollm2, seed=0, hidden_size=32, head_dim=8)
    cfg = recipe(tiny_overrides(other, tmp_path / "run", tiny_store, "train.steps=1"))
    with pytest.raises(ValueError, match="another target.*config_hash"):
        train(cfg)


def test_static_fp8_is_refused_before_the_first_step_when_training_validates(
    tiny_target, tiny_store, tmp_path
):
    """Validation loads the target and does not calibrate static FP8 scales (only precompute does)."""
    extra = ["model.quantization=fp8_static", "train.steps=2", "train.validate_every=1"]
    with pytest.raises(
        ValueError,
        match=r"fp8_static: validation during training \(train.validate_every\) does not calibrate",
    ):
        train(recipe(tiny_overrides(tiny_target, tmp_path / "run", tiny_store, *extra)))
    assert not (tmp_path / "run" / "train" / "metrics.jsonl").exists()  # refused before any step


def test_set_aside_records_the_store_trained_on_are_refused_before_the_first_step(
    tiny_target, tiny_store, tmp_path
):
    """The store holds every GSM8K record (made with data.holdout=0): validating on its first
    records as set-aside text would score the head on what it trained on."""
    extra = [f"data.train_files=[{GSM8K}]", "data.holdout=4", "train.steps=2", "train.validate_every=1"]
    with pytest.raises(ValueError, match=r"made with data.holdout=0, so the head trained on records 0..3"):
        train(recipe(tiny_overrides(tiny_target, tmp_path / "run", tiny_store, *extra)))
    assert not (tmp_path / "run" / "train" / "metrics.jsonl").exists()


def test_validation_runs_inside_training(tiny_target, tiny_store, tmp_path):
    mt_bench = Path(__file__).resolve().parent.parent / "data" / "mt_bench.jsonl"
    run = tmp_path / "run"
    extra = [
        "train.steps=6",
        "train.save_every=0",
        "train.validate_every=3",
        "train.spec_validate_at=[6]",
        f"validate.eval_files=[{mt_bench}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=8",
        "validate.chain_lengths=[2]",
        "validate.teacher_forced_samples=2",
    ]
    train(recipe(tiny_overrides(tiny_target, run, tiny_store, *extra)))
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    validations = {r["step"]: r for r in rows if "val/loss" in r}
    assert sorted(validations) == [3, 6]
    assert validations[3]["val/parity_gap"] < 1e-3 and "val/tau_k2" not in validations[3]
    v = validations[6]
    chain = {
        "mean_accepted_len": v["val/tau_k2"],
        "accept_rate": [v["val/accept_k2_pos1"], v["val/accept_k2_pos2"]],
    }
    assert_tau_consistent(chain, k=2)
    assert (run / "train" / "head-latest" / "head.safetensors").exists()
    recorded = json.loads((run / "train" / "head-latest" / "config.json").read_text())["training"]["data"]
    assert recorded["train_files"] == [str(GSM8K)] and recorded["holdout"] == 0  # the store's data
    # so standalone validation refuses set-aside text the head trained on, before loading anything
    held_out = recipe(
        tiny_overrides(tiny_target, run, tiny_store, f"data.train_files=[{GSM8K}]", "data.holdout=2")
    )
    with pytest.raises(ValueError, match=r"head-latest's training data: made with data.holdout=0"):
        holdout_samples(held_out, None, run / "train" / "head-latest")


def test_bf16_mixed_precision_trains_fp32_master_weights_close_to_fp32(tiny_target, tiny_store, tmp_path):
    """train.precision=bf16 (the one-process default on a GPU): the head's parameters and AdamW
    state stay fp32 while its matmuls run in bf16, and the loss follows the fp32 run's."""
    import torch

    from mtp_train.train import micro_batches, set_up, train_step

    common = ["train.steps=4", "train.save_every=0", "train.lr=3e-3"]
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = tmp_path / precision
        train(
            recipe(
                tiny_overrides(
                    tiny_target, runs[precision], tiny_store, *common, f"train.precision={precision}"
                )
            )
        )
    fp32, bf16 = metrics(runs["fp32"]), metrics(runs["bf16"])
    for step in range(1, 5):
        assert bf16[step]["loss"] == pytest.approx(fp32[step]["loss"], rel=0.03), step
    assert any(bf16[s]["loss"] != fp32[s]["loss"] for s in range(1, 5))  # bf16 did run
    assert bf16[4]["loss"] < bf16[1]["loss"]

    # One step by hand: the layer's linears compute in bf16, the weights and AdamW's moments are fp32.
    cfg = recipe(tiny_overrides(tiny_target, tmp_path / "hand", tiny_store, *common, "train.precision=bf16"))
    t, _, states, _ = set_up(cfg)
    head = t.acc.unwrap_model(t.objective).head
    seen = set()
    hook = head.layer.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    linears = [m for m in head.layer.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda m, i, out: seen.add(("linear", out.dtype))) for m in linears]
    train_step(t, micro_batches(t, states, 0, t.acc.device))
    hook.remove()
    for h in hooks:
        h.remove()
    assert t.autocast == torch.bfloat16 and ("linear", torch.bfloat16) in seen
    assert all(p.dtype == torch.float32 for p in head.parameters())
    moments = [s["exp_avg"] for s in t.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)


def test_precision_is_refused_under_deepspeed_unless_auto():
    from types import SimpleNamespace

    from mtp_train.config import TrainConfig
    from mtp_train.train import autocast_dtype

    acc = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=object()), device=SimpleNamespace(type="cuda")
    )
    assert autocast_dtype(acc, TrainConfig(precision="auto")) is None
    with pytest.raises(ValueError, match="train.precision=bf16 is for runs without DeepSpeed"):
        autocast_dtype(acc, TrainConfig(precision="bf16"))
    cpu = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), device=SimpleNamespace(type="cpu"))
    assert autocast_dtype(cpu, TrainConfig(precision="auto")) is None  # a CPU's bf16 is slow without AMX
