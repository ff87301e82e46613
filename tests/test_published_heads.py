"""The heads published in `heads/` (each directory a `vllm` export that stock vLLM serves as it is
and that our loop reads back): each validated on a few MT-bench questions through our loop and
through vLLM on a CPU (fp32, greedy), its τ as its card says and vLLM's counts equal to ours."""

from __future__ import annotations

import hashlib
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mtp_train.serving import vllm_engine

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "heads" / "smollm2_135m"
CARD = json.loads((PUBLISHED / "card.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_files_are_the_cards(name):
    """What the card describes is what is in the repository, and within the size a head may take."""
    head = CARD["heads"][name]
    weights = PUBLISHED / head["dir"] / "model.safetensors"
    assert sha256(weights) == head["sha256"]
    assert weights.stat().st_size <= 12 * 2**20


@pytest.mark.skipif(find_spec("vllm") is None, reason=f"vLLM is not installed: {vllm_engine.INSTALL}")
@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_head_serves_as_its_card_says(name, smollm2, tmp_path):
    from mtp_train.validate import run_validation

    head, check = CARD["heads"][name], CARD["heads"][name]["cpu_check"]
    overrides = [
        "model=smollm2_135m",
        f"model.target={smollm2}",
        f"model.variant={head['variant']}",
        f"run_dir={tmp_path}",
        f"validate.head={PUBLISHED / head['dir']}",
        f"validate.eval_files=[{REPO / 'data' / 'mt_bench.jsonl'}]",
        f"validate.num_prompts={check['prompts']}",
        f"validate.max_new_tokens={check['max_new_tokens']}",
        f"validate.chain_lengths=[{check['k']}]",
        "validate.temperatures=[0.0]",
        f"validate.batch_size={check['prompts']}",
        "validate.teacher_forced_samples=2",
        "validate.dtype=float32",
        "validate.engine=vllm",
        "validate.engine_target_alone=false",
        f"validate.report={tmp_path / 'report.json'}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        cfg = compose("config", overrides=overrides)
    OmegaConf.resolve(cfg)
    report = run_validation(cfg)
    ours = report["speculative"]["greedy"][f"k={check['k']}"]
    engine = report["engine"]["speculative"]["greedy"][f"k={check['k']}"]
    print(json.dumps({"ours": ours["mean_accepted_len"], "vllm": engine["counts"]}))
    assert ours["identical_to_target_greedy"]
    assert engine["gap"]["counts_equal"], engine
    assert ours["mean_accepted_len"] == pytest.approx(check["tau"], abs=check["tolerance"])
