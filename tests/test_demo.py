"""End to end on the real SmolLM2 target: a smaller version of the README's demo."""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.demo import run_demo
from tiny import assert_serves_as_trained


def test_demo_pipeline_end_to_end(tmp_path, smollm2, capsys):
    run = tmp_path / "demo"
    overrides = [
        f"run_dir={run}",
        "model.dtype=float32",  # the parity check below is the fp32 one
        "regenerate.limit=12",
        "regenerate.max_new_tokens=24",
        "regenerate.batch_size=12",
        "data.max_seq_len=160",
        "train.steps=12",
        "train.tokens_per_micro_batch=1024",
        "train.warmup_steps=2",
        "train.save_every=6",
        "validate.num_prompts=2",
        "validate.max_new_tokens=16",
        "validate.chain_lengths=[2]",
        "validate.teacher_forced_samples=2",
        "export.formats=[native]",
        # vLLM's side of validation is tested in test_vllm.py (two engine starts would double this test)
        "validate.engine=inference_ref",
    ]
    report = run_demo(overrides)
    # Every stage left its product where the next one and the user look for it.
    assert (run / "regenerated.jsonl").exists()
    assert json.loads((run / "store" / "manifest.json").read_text())["num_samples"] > 0
    assert (run / "train" / "head" / "head.safetensors").exists()
    assert (run / "export" / "native" / "config.json").exists()
    assert Path(report["head"]) == run / "train" / "head"
    # fp32 on CPU: the target's output, and the training module and the serving draft agree.
    assert_serves_as_trained(report, k=2)
    assert (run / "validate" / "report.png").exists()

    # A rerun resumes every finished stage, validation included, and prints the same summary.
    captured = capsys.readouterr()
    first = captured.out
    # validation shows its progress: answers done, new tokens/s, ETA
    assert "validate: target alone" in captured.err and "validate: greedy, k=2" in captured.err
    trained = (run / "train" / "train_summary.json").read_text()
    again = run_demo(overrides)
    second = capsys.readouterr().out
    assert "was made with this head and these settings; reused" in second
    assert again == report and (run / "train" / "train_summary.json").read_text() == trained
    summary = lambda out: out[out.index("=== summary ===") :].splitlines()[:-1]  # noqa: E731 (total time differs)
    assert summary(second) == summary(first)
