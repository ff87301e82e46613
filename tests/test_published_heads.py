"""The heads published in `heads/` (each directory a `vllm` export that stock vLLM serves as it is
and that our loop reads back): what the card describes is in the repository, and each directory is
what the exporter writes today, byte for byte. vLLM serving each directory itself, with our loop's
and the card's counts, is tests/test_vllm.py's (`served`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mtp_train.export import ENGINE_WEIGHTS, export_layouts

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "heads" / "smollm2_135m"
CARD = json.loads((PUBLISHED / "card.json").read_text())


@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_files_are_the_cards(name):
    """What the card describes is what is in the repository, within the size a head may take."""
    head = CARD["heads"][name]
    weights = PUBLISHED / head["dir"] / ENGINE_WEIGHTS
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == head["sha256"]
    assert weights.stat().st_size <= 12 * 2**20


@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_a_published_directory_is_what_the_exporter_writes_today(name, smollm2, tmp_path):
    """Read back as its native head and exported again in the `vllm` layout (at its own dtype), a
    published head gives the same weights file and the same config: what vLLM is shown to serve in
    tests/test_vllm.py is what `python -m mtp_train.export export.formats=[vllm]` writes."""
    published = PUBLISHED / CARD["heads"][name]["dir"]
    config = json.loads((published / "config.json").read_text())
    again = export_layouts(published, smollm2, ["vllm"], tmp_path, dtype=config["torch_dtype"])["vllm"]
    assert (again / ENGINE_WEIGHTS).read_bytes() == (published / ENGINE_WEIGHTS).read_bytes()
    assert json.loads((again / "config.json").read_text()) == config
