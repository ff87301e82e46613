"""Every stage command in the README runs as written: its overrides compose into a valid config
(`config.checked`), the files and launch configs it names exist, with the tiny target as `$T`
(a dry run: nothing is computed)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mtp_train.config import checked
from tiny import recipe

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The `-m mtp_train.<stage>` commands of the README's bash blocks, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    joined = "\n".join(block.replace("\\\n", " ") for block in blocks)
    return [line.split("#")[0].strip() for line in joined.splitlines() if "-m mtp_train." in line]


COMMANDS = readme_commands()


def test_the_readme_has_stage_commands():
    stages = {re.search(r"-m mtp_train\.(\w+)", c)[1] for c in COMMANDS}
    assert {"regenerate", "precompute", "train", "validate", "export"} <= stages


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_composes_and_names_what_exists(command, tiny_target):
    words = shlex.split(command.replace("$T", str(tiny_target)))
    if "--config_file" in words:
        assert (REPO / words[words.index("--config_file") + 1]).exists()
    overrides = words[words.index(next(w for w in words if w.startswith("mtp_train."))) + 1 :]
    cfg = recipe(overrides)
    checked(cfg)
    for value in re.findall(r"\[([^\]]*)\]", " ".join(overrides)):
        for path in value.split(","):
            if path.startswith("data/"):
                assert (REPO / path).exists(), path
