"""End to end on the real SmolLM2 target: a smaller version of the README's demo."""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.demo import run_demo
from tiny import assert_tau_consistent


def test_demo_pipeline_end_to_end(tmp_path, smollm2):
    run = tmp_path / "demo"
    report = run_demo(
        [
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
        ]
    )
    # Every stage left its product where the next one and the user look for it.
    assert (run / "regenerated.jsonl").exists()
    assert json.loads((run / "store" / "manifest.json").read_text())["num_samples"] > 0
    assert (run / "train" / "head" / "head.safetensors").exists()
    assert (run / "export" / "native" / "config.json").exists()
    assert Path(report["head"]) == run / "train" / "head"
    greedy = report["speculative"]["greedy"]["k=2"]
    assert greedy["identical_to_target_greedy"]
    assert_tau_consistent(greedy, k=2)
    assert len(greedy["accept_rate"]) == 2
    tf = report["teacher_forced"]
    # fp32 on CPU: the training module and the serving draft agree.
    assert tf["parity_gap"]["ce"] < 1e-3 * max(1.0, tf["trainer"]["ce"])
    assert (run / "validate" / "report.png").exists()
