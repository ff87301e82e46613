"""Integrity: nonsense config values and unknown keys are refused with one line, a non-finite loss
stops training before it reaches the weights, a non-finite head is never exported, and a damaged
store stops training until it is repaired and precomputed again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mtp_train import export as ex
from mtp_train.config import ConfigError, checked
from mtp_train.precompute import run_precompute
from mtp_train.store import Store, read_shard, repair
from mtp_train.train import NonFiniteLoss, train
from tiny import recipe

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "tests" / "data" / "gsm8k_64.jsonl"


@pytest.mark.parametrize(
    "override, field",
    [
        ("+train.bogus_key=1", "train.bogus_key"),
        ("train.grad_clip=-1", "train.grad_clip"),
        ("train.steps=0", "train.steps"),
        ("train.steps=-3", "train.steps"),
        ("train.tokens_per_micro_batch=0", "train.tokens_per_micro_batch"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.grad_accum=0", "train.grad_accum"),
        ("train.unroll_steps=0", "train.unroll_steps"),
        ("train.betas=[0.9]", "train.betas"),
        ("data.max_seq_len=-1", "data.max_seq_len"),
        ("data.holdout=-1", "data.holdout"),
        ("validate.temperatures=[-1.0]", "validate.temperatures"),
        ("validate.chain_lengths=[0]", "validate.chain_lengths"),
        ("validate.batch_size=0", "validate.batch_size"),
        ("validate.num_prompts=0", "validate.num_prompts"),
        ("export.dtype=int8", "export.dtype"),
    ],
)
def test_nonsense_config_values_are_refused_naming_the_field(override, field):
    cfg = recipe(["model.target=unused", override])
    with pytest.raises(ConfigError) as error:
        checked(cfg)
    assert field in str(error.value) and "\n" not in str(error.value)


def test_the_default_config_passes(tiny_target):
    checked(recipe([f"model.target={tiny_target}"]))


def tiny(target: Path, run: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        f"run_dir={run}",
        f"data.train_files=[{GSM8K}]",
        "data.max_samples=16",
        "train.tokens_per_micro_batch=512",
        "logging.log_every=1",
        *extra,
    ]


def test_a_non_finite_loss_stops_training_before_it_is_applied(tiny_target, tmp_path):
    cfg = recipe(tiny(tiny_target, tmp_path, "train.lr=1e20", "train.steps=6", "train.save_every=1"))
    run_precompute(cfg)
    with pytest.raises(NonFiniteLoss, match="train.lr"):
        train(cfg)
    assert not (tmp_path / "train" / "head").exists()  # nothing exported
    ckpts = sorted((tmp_path / "train").glob("ckpt-*"))
    assert ckpts  # save_every=1: the steps before the stop were saved, so the loop below checks some
    for ckpt in ckpts:  # every checkpoint written before the stop is finite
        from safetensors.torch import load_file

        tensors = load_file(str(next(ckpt.glob("*.safetensors"))))
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def test_export_refuses_a_non_finite_head(tiny_target, tmp_path):
    from mtp_train.heads import HeadSpec, MTPHead
    from mtp_train.run import Target

    target = Target.resolve(str(tiny_target))
    from inference_ref.target import frozen_target_tensors

    head = MTPHead(HeadSpec("rmsnorm-restored", target.config), frozen_target_tensors(tiny_target))
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight has 1 non-finite"):
        ex.save_head(head, tmp_path / "head", target.identity, {})
    assert not (tmp_path / "head").exists()


def test_a_damaged_store_stops_training_until_repaired(tiny_target, tmp_path):
    cfg = recipe(
        tiny(tiny_target, tmp_path, "train.steps=2", "train.save_every=0", "precompute.shard_tokens=1024")
    )
    store_dir = run_precompute(cfg)
    shards = Store(store_dir).manifest["shards"]
    assert len(shards) > 1
    victim = store_dir / shards[1]["file"]
    data = bytearray(victim.read_bytes())
    data[-100:-90] = bytes(10)  # hidden states of the shard's last sample
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{shards[1]['file']} is corrupted.*repair"):
        train(cfg)
    assert repair(store_dir) == [shards[1]["file"]]
    assert not (store_dir / "manifest.json").exists()
    run_precompute(cfg)  # redoes the dropped shard's samples only
    store = Store(store_dir)
    store.verify()
    assert store.manifest["num_samples"] == sum(s["samples"] for s in shards)
    assert train(cfg).exists()


def test_a_shard_cut_short_is_refused_in_one_line_before_training_reads_it(tiny_target, tmp_path):
    """Training opens the shards before it verifies them: a file cut short (a disk that filled, a
    copy that stopped) must still be named, with the repair, not fail reshaping a view."""
    cfg = recipe(
        tiny(tiny_target, tmp_path, "train.steps=2", "train.save_every=0", "precompute.shard_tokens=1024")
    )
    store_dir = run_precompute(cfg)
    (store_dir / "verified.json").write_text('{"shard-')  # verify's cache, unreadable: hashed again
    Store(store_dir).verify()
    assert json.loads((store_dir / "verified.json").read_text())
    victim = store_dir / Store(store_dir).manifest["shards"][0]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-4096])
    with pytest.raises(ValueError, match=rf"^{victim}: {len(data) - 4096:,} bytes, .* cut short; repair"):
        train(cfg)
    victim.write_bytes(b"\xff" * 16)  # a header length past the file
    with pytest.raises(ValueError, match=rf"^{victim}: damaged safetensors header .*; repair"):
        read_shard(victim)


def test_resume_falls_back_past_damaged_checkpoints_and_refuses_another_plan(tiny_target, tmp_path, capsys):
    extra = ("train.save_every=2", "data.max_samples=16")
    cfg = recipe(tiny(tiny_target, tmp_path, "train.steps=4", *extra))
    run_precompute(cfg)
    train(cfg)
    out = tmp_path / "train"
    assert [p.name for p in sorted(out.glob("ckpt-*"))] == ["ckpt-0000002", "ckpt-0000004"]
    weights = out / "ckpt-0000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # bit flips in the latest checkpoint's weights
    weights.write_bytes(bytes(data))
    more = recipe(tiny(tiny_target, tmp_path, "train.steps=6", *extra))
    capsys.readouterr()
    train(more)
    printed = capsys.readouterr().out
    assert "ckpt-0000004 is damaged (model.safetensors does not match its sha256)" in printed
    assert "resumed from" in printed and "ckpt-0000002 at step 2" in printed
    # A final-named checkpoint that lost its state.json never blocks a rerun.
    (out / "ckpt-0000006" / "state.json").unlink()
    capsys.readouterr()
    train(more)
    assert "ckpt-0000006 is damaged (state.json unreadable" in capsys.readouterr().out
    assert (out / "ckpt-0000006" / "state.json").exists()  # written again over the leftover
    with pytest.raises(ValueError, match="another plan"):
        train(
            recipe(tiny(tiny_target, tmp_path, "train.steps=8", "train.tokens_per_micro_batch=256", *extra))
        )


def test_input_errors_name_the_file_and_line(tmp_path, tiny_target):
    from mtp_train.data import DataFormatError, iter_records

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: not UTF-8"):
        list(iter_records(bad))
    array = tmp_path / "bad.json"
    array.write_bytes(b'[\n{"question": "a", "answer": "b"},\n{"question": "\xff"}\n]')
    with pytest.raises(DataFormatError, match=r"bad.json:3: not UTF-8"):
        list(iter_records(array))


def test_a_shard_index_pointing_outside_the_target_is_refused(tmp_path):
    import json

    from inference_ref.loading import safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../other/model.safetensors"}})
    )
    with pytest.raises(ValueError, match="outside the target directory"):
        safetensors_files(tmp_path)


def test_precompute_reports_what_it_kept(tiny_target, tmp_path, capsys):
    cfg = recipe(tiny(tiny_target, tmp_path, "data.max_seq_len=200", "data.overlong=drop"))
    run_precompute(cfg)
    printed = capsys.readouterr().out
    assert "16 records →" in printed and "dropped as over-long" in printed
    # every record dropped: no empty store, but the counts that say why
    cfg = recipe(tiny(tiny_target, tmp_path / "none", "data.max_seq_len=64", "data.overlong=drop"))
    with pytest.raises(ValueError, match="give no training sample: 16 records .* 16 dropped as longer than"):
        run_precompute(cfg)


def test_a_manifest_missing_a_shard_or_unreadable_is_refused(tiny_target, tmp_path):
    import json

    cfg = recipe(tiny(tiny_target, tmp_path, "train.steps=1", "precompute.shard_tokens=1024"))
    store_dir = run_precompute(cfg)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][1:]  # one shard's entry deleted, the count kept
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest is damaged"):
        Store(store_dir).verify()
    (store_dir / "manifest.json").write_text('{"shards": [')
    with pytest.raises(ValueError, match=r"manifest.json: damaged \(JSONDecodeError"):
        Store(store_dir)


class Payload:
    def __reduce__(self):
        return (print, ("this ran on load",))


def test_deepspeed_checkpoints_are_read_without_running_code(tmp_path, capsys):
    """DeepSpeed's engine asks torch.load for weights_only=False; inside `weights_only_loads` a
    crafted checkpoint is refused instead of run (GPU round trip: benchmarks/deepspeed_resume_check.sh)."""
    import pickle

    from mtp_train.checkpoint import weights_only_loads

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": Payload()}, path)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False)
    assert "this ran on load" not in capsys.readouterr().out
    assert torch.load(path, weights_only=False)["module"] == {}  # outside, torch.load is itself again


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tiny_target, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from inference_ref.target import load_target

    bad = tmp_path / "target"
    shutil.copytree(tiny_target, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][
        :, :32
    ].contiguous()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.mlp.up_proj.weight has shape \[128, 32\], config.json implies \[128, 64\]",
    ):
        load_target(bad)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight \[128, 64\] is missing"):
        load_target(bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' is not supported \(llama, qwen3, qwen3_moe, deepseek_v2, deepseek_v3\)",
    ):
        load_target(bad)


@pytest.mark.parametrize(
    "module, overrides, message",
    [
        ("mtp_train.precompute", [], "error: data.train_files is empty"),
        ("mtp_train.train", ["train.grad_clip=-1"], "error: train.grad_clip=-1.0: must be > 0"),
        (
            "mtp_train.regenerate",
            ["regenerate.prompts=[missing.jsonl]"],
            "error: missing.jsonl: no such file",
        ),
    ],
)
def test_entry_points_report_user_errors_in_one_line(tiny_target, tmp_path, module, overrides, message):
    """No traceback, exit code 2, the field or file and the fix; HYDRA_FULL_ERROR=1 shows the traceback."""
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        module,
        "model=tiny_random",
        f"model.target={tiny_target}",
        f"run_dir={tmp_path}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    done = subprocess.run(cmd + overrides, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr


def test_one_writer_per_run_folder_and_per_store(tiny_target, tmp_path):
    """A second training on a `train.out_dir`, or a second precompute on a store, that a running
    process holds is refused in one line naming it, before anything is read or written; a lock file
    left by a killed run (no process holds it any more) is taken over."""
    import os

    from mtp_train.locks import Busy, exclusive

    cfg = recipe(tiny(tiny_target, tmp_path, "train.steps=2"))
    store, out = Path(cfg.precompute.store_dir), Path(cfg.train.out_dir)
    with exclusive(store, "precompute.store_dir"):  # as a precompute in progress would
        with pytest.raises(Busy, match=rf"{store} is in use by pid {os.getpid()} on .*precompute.store_dir"):
            run_precompute(cfg)
    assert sorted(p.name for p in store.iterdir()) == [".lock"]  # nothing else written meanwhile
    (store / ".lock").write_text("pid 999999 on a-host-that-was-killed\n")  # stale: nobody holds it
    run_precompute(cfg)
    with exclusive(out, "train.out_dir"):
        with pytest.raises(Busy, match=f"pid {os.getpid()}") as error:
            train(cfg)
        assert "train.out_dir" in str(error.value) and "\n" not in str(error.value)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    assert Path(train(cfg)).is_dir()  # released: the run goes ahead


def test_a_target_with_non_finite_states_is_refused_naming_the_sample(tiny_target, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from mtp_train.precompute import NonFiniteStates

    target = tmp_path / "overflowing"
    shutil.copytree(tiny_target, target)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float(
        "inf"
    )  # as a corrupted or overflowing weight
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    cfg = recipe(tiny(target, tmp_path / "run"))
    with pytest.raises(NonFiniteStates, match=r"gsm8k_64.jsonl:\d+: the target's states are NaN or inf") as e:
        run_precompute(cfg)
    assert "\n" not in str(e.value) and "model.dtype" in str(e.value)
    assert not (Path(cfg.precompute.store_dir) / "manifest.json").exists()  # never published


def test_a_dead_head_stops_training_and_is_not_exported(tiny_target, tmp_path):
    from mtp_train.train import DeadHead

    cfg = recipe(tiny(tiny_target, tmp_path, "train.lr=1e4", "train.steps=60", "train.dead_steps=5"))
    run_precompute(cfg)
    with pytest.raises(
        DeadHead, match=r"gradient norm has been 0 for 5 steps in a row .*train.lr \(now 10000\)"
    ):
        train(cfg)
    assert not (tmp_path / "train" / "head").exists()


def test_resume_says_what_changed_and_applies_it_or_refuses_it(tiny_target, tmp_path, capsys):
    """Another lr or number of steps on resume is applied from the resumed step on and said; another
    head kind is refused in one line; an edited state.json is damage; the steps a killed run logged
    after its last checkpoint are not logged twice."""
    import json
    import shutil

    from mtp_train.train import warmup_cosine

    def metrics():
        return [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]

    base = tiny(tiny_target, tmp_path, "train.save_every=2", "train.warmup_steps=1")
    run_precompute(recipe(base + ["train.steps=3"]))
    train(recipe(base + ["train.steps=3"]))
    shutil.rmtree(tmp_path / "train" / "ckpt-0000003")  # killed after step 3, before its checkpoint
    capsys.readouterr()
    train(recipe(base + ["train.steps=6", "train.lr=2e-3", "train.weight_decay=0.05"]))
    out = capsys.readouterr().out
    assert "resumed from" in out and "ckpt-0000002 at step 2" in out
    assert "resume: train.lr was 0.001, now 0.002: applied from step 3 on" in out
    assert "resume: train.steps was 3, now 6: applied from step 3 on" in out
    assert "resume: train.weight_decay was 0.0, now 0.05" in out
    steps = [m["step"] for m in metrics() if "lr" in m]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 3 once
    lr3 = next(m["lr"] for m in metrics() if m["step"] == 3 and "lr" in m)
    # (a step logs the lr its scheduler step leaves: the next step's, on the new schedule)
    assert lr3 == pytest.approx(2e-3 * warmup_cosine(1, 6, recipe(base).train.min_lr_ratio)(3))

    with pytest.raises(ValueError, match="made with another head") as error:
        train(recipe(base + ["train.steps=8", "model.variant=eagle1"]))
    assert "\n" not in str(error.value)

    state = tmp_path / "train" / "ckpt-0000006" / "state.json"
    edited = json.loads(state.read_text())
    edited["step"] = 5
    state.write_text(json.dumps(edited))
    train(recipe(base + ["train.steps=8"]))
    out = capsys.readouterr().out
    assert "ckpt-0000006 is damaged (state.json does not match its sha256" in out and "at step 4" in out


def test_more_user_errors_are_one_line(tiny_target, tmp_path, capsys):
    """An unset mandatory value, a full disk, a head whose config.json is not JSON, an empty data
    file: one line each, naming the field or the file, exit code 2."""
    import errno

    from mtp_train.cli import one_line_errors

    def one_line(fn) -> str:
        with pytest.raises(SystemExit) as e:
            one_line_errors(fn)()
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 2, err  # the error, the hint
        return err

    assert "model.target is not set" in one_line(lambda: checked(recipe(["model=tiny_random"])))

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt-0000010" / "x"))

    assert f"no space left on the device writing {tmp_path}/ckpt-0000010/x" in one_line(full_disk)

    def full_disk_in_the_store_writer():  # precompute's writer thread: its failure raised again, wrapped
        try:
            full_disk()
        except OSError as e:
            raise RuntimeError("writing the store failed") from e

    assert "no space left on the device writing" in one_line(full_disk_in_the_store_writer)

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{not json")
    assert f"{head}/config.json: not valid JSON" in one_line(lambda: ex.read_head_config(head))

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = recipe(tiny(tiny_target, tmp_path / "run", f"data.train_files=[{empty}]"))
    assert "give no training sample: 0 records" in one_line(lambda: run_precompute(cfg))
    assert not (tmp_path / "run" / "store" / "manifest.json").exists()


def test_a_manifest_missing_a_shard_is_found_and_rebuilt(tiny_target, tmp_path):
    """A shard entry deleted from manifest.json with the counts edited to match: verify names it
    against the run's records (run.json, the journals), repair drops the manifest, and precompute
    merges it again from the ranks' records, whole."""
    import json

    cfg = recipe(tiny(tiny_target, tmp_path, "precompute.shard_tokens=1000"))
    store_dir = run_precompute(cfg)
    path = store_dir / "manifest.json"
    whole = json.loads(path.read_text())
    assert len(whole["shards"]) > 1
    cut = dict(whole, shards=whole["shards"][1:])
    cut["num_samples"] = sum(s["samples"] for s in cut["shards"])
    path.write_text(json.dumps(cut))
    with pytest.raises(
        ValueError, match=r"manifest.json lists \d+ samples, the run precomputed 16 \(run.json\)"
    ):
        Store(store_dir).verify()
    (store_dir / "run.json").write_text(
        json.dumps(
            dict(
                json.loads((store_dir / "run.json").read_text()),
                data={**whole["data"], "num_samples": cut["num_samples"]},
            )
        )
    )  # the run's count edited too: the journals still say which shards were committed
    with pytest.raises(
        ValueError,
        match=r"journal-00000.jsonl committed shard-00000-\d+.safetensors, which manifest.json does not list",
    ):
        Store(store_dir).verify()
    (store_dir / "run.json").write_text(
        json.dumps(dict(json.loads((store_dir / "run.json").read_text()), data=whole["data"]))
    )
    assert repair(store_dir) == ["manifest.json"]
    run_precompute(cfg)
    assert json.loads(path.read_text())["num_samples"] == 16
    said: list[str] = []
    Store(store_dir).verify(full=True, say=said.append)  # the hashing is announced, with its size
    (line,) = said
    assert re.fullmatch(
        rf"store {re.escape(str(store_dir))}: hashing (\d+) of \1 shards \([\d.]+ GB\) against the manifest",
        line,
    )
    Store(store_dir).verify(say=said.append)  # cached: nothing hashed, nothing said
    assert len(said) == 1
