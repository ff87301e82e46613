"""Training without a store (#38): `train.states=online` runs the target in the training job and
gives the store path's losses step for step (fp32, CPU), for restored and eagle3 heads, in one
process and with the target sharded over a tensor-parallel group of two (gloo); `auto` chooses and
says why; an online run resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train import states as states_module
from mtp_train.precompute import run_precompute
from mtp_train.target_files import write_random_target
from mtp_train.train import train
from tiny import recipe

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "tests" / "data" / "gsm8k_64.jsonl"
STEPS = 5


def overrides(target: Path, run: Path, variant: str, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        f"model.variant={variant}",
        *(["model.aux_layers=[1,2,3]", "precompute.aux=true"] if variant == "eagle3" else []),
        f"run_dir={run}",
        f"data.train_files=[{GSM8K}]",
        "data.max_samples=24",
        f"train.steps={STEPS}",
        "train.unroll_steps=2",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.tokens_per_micro_batch=512",
        "train.save_every=0",
        "logging.log_every=1",
        *extra,
    ]


def losses(run: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["top1"]) for r in rows if "loss" in r}


def assert_same_losses(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step][0] == pytest.approx(a[step][0], rel=1e-5), (step, a[step], b[step])
        assert b[step][1] == pytest.approx(a[step][1], abs=1e-6), step


@pytest.fixture(scope="module")
def target(smollm2, tmp_path_factory):
    """A 4-layer random Llama with SmolLM2's tokenizer (eagle3's three layers fit)."""
    out = tmp_path_factory.mktemp("online_target")
    return write_random_target(out, smollm2, seed=2, num_hidden_layers=4, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def store_runs(target, tmp_path_factory):
    """Each kind trained the store way (precompute, then train.states=store): the reference losses."""
    runs = {}
    for variant in ("rmsnorm-restored", "eagle3"):
        run = tmp_path_factory.mktemp(f"store_{variant}")
        cfg = recipe(overrides(target, run, variant, "train.states=store"))
        run_precompute(cfg)
        train(cfg)
        runs[variant] = run
    return runs


@pytest.mark.parametrize("variant", ["rmsnorm-restored", "eagle3"])
def test_online_training_gives_the_store_losses(variant, target, store_runs, tmp_path, capsys):
    train(recipe(overrides(target, tmp_path, variant, "train.states=online")))
    out = capsys.readouterr().out
    assert "train: states online (train.states=online)" in out and "a store would take" in out
    assert "online: the target's forwards took" in out
    assert not (tmp_path / "store").exists()  # nothing written but the run's own files
    assert_same_losses(losses(store_runs[variant]), losses(tmp_path))


def test_online_with_the_target_sharded_over_two_processes(target, store_runs, tmp_path):
    """model.tp_size=2 over two gloo processes: the target is sharded, the two ranks forward the
    same micro-batches together and train the head on them (one data-parallel group)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = overrides(target, tmp_path, "eagle3", "train.states=online", "model.tp_size=2")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*cmd, "-m", "mtp_train.train", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "online: the target on 2 process(es) per copy, 1 data-parallel copies" in done.stdout
    assert_same_losses(losses(store_runs["eagle3"]), losses(tmp_path))


def test_auto_takes_the_store_or_goes_online_and_says_why(target, store_runs, tmp_path, monkeypatch, capsys):
    from mtp_train.run import Target, head_spec

    cfg = recipe(overrides(target, store_runs["rmsnorm-restored"], "rmsnorm-restored"))
    t = Target.resolve(str(target))
    spec = head_spec(cfg.model, t.config, t.dir)
    assert states_module.choose(cfg, spec, t.dir)[0] == "store"
    assert "train.states=auto: a store is there" in capsys.readouterr().out
    fresh = recipe(overrides(target, tmp_path, "rmsnorm-restored"))
    with pytest.raises(ValueError, match="precompute it .* or train with train.states=online"):
        states_module.choose(fresh, spec, t.dir)

    class Tiny:
        free = 1000  # bytes: no store fits

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Tiny)
    mode, data = states_module.choose(fresh, spec, t.dir)
    assert mode == "online" and len(data) == 24
    out = capsys.readouterr().out
    assert "states online (train.states=auto): no store at" in out and "1.0 KB is free" in out


def test_an_online_run_resumes_exactly(target, tmp_path):
    """Stopped after 3 steps (a checkpoint each step) and resumed to 5: the uninterrupted run's
    losses (a constant lr, so that the first part's shorter schedule is the same schedule)."""
    constant = ("train.states=online", "train.warmup_steps=0", "train.min_lr_ratio=1.0")
    whole = tmp_path / "whole"
    train(recipe(overrides(target, whole, "rmsnorm-restored", *constant)))
    parts = tmp_path / "parts"
    common = (*constant, "train.save_every=1")
    train(recipe(overrides(target, parts, "rmsnorm-restored", *common, "train.steps=3")))
    train(recipe(overrides(target, parts, "rmsnorm-restored", *common)))
    assert_same_losses(losses(whole), losses(parts))
