"""`--help` of every entry point answers without importing torch (or transformers, DeepSpeed,
accelerate: seconds on a small CPU), and every config group it lists can be used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train.config import checked
from tiny import recipe

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "deepspeed", "accelerate")
STAGES = ("regenerate", "precompute", "train", "validate", "export")


def imported_by_help(module: str) -> tuple[str, set[str]]:
    """The help text of `python -m module --help`, and the top-level packages it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # -X importtime writes "import time: self | cumulative | name" to stderr for every import.
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    return done.stdout, names


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_is_hydras_without_torch(stage):
    text, imported = imported_by_help(f"mtp_train.{stage}")
    assert not imported & set(HEAVY), imported & set(HEAVY)
    assert text.startswith(f"{stage} is powered by Hydra.")
    assert "model: " in text and "train:\n  store_dir:" in text  # the groups and the schema's fields


@pytest.mark.parametrize("module, says", [("demo", "usage: python -m mtp_train.demo"), ("store", "verify")])
def test_other_entry_points_help_without_torch(module, says):
    text, imported = imported_by_help(f"mtp_train.{module}")
    assert not imported & set(HEAVY), imported & set(HEAVY)
    assert says in text


def model_options() -> list[str]:
    return sorted(p.stem for p in (REPO / "recipes" / "model").glob("*.yaml"))


def test_the_help_lists_exactly_the_model_recipes():
    text, _ = imported_by_help("mtp_train.train")
    (line,) = [x for x in text.splitlines() if x.startswith("model: ")]
    assert line.removeprefix("model: ").split(", ") == model_options()


@pytest.mark.parametrize("option", model_options())
def test_every_listed_model_option_composes(option, tiny_target):
    cfg = recipe([f"model={option}", f"model.target={tiny_target}"])
    assert checked(cfg).model.name == option
