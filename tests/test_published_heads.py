"""The heads published in `heads/` (each directory a `vllm` export that stock vLLM serves as it is
and that our loop reads back): on the first MT-bench questions, on a CPU in fp32, greedy, our loop's
τ is the card's and vLLM, serving the published directory itself, counts what our loop counts
(that greedy speculative output is the target's own is the loop's property, tests/test_speculative.py)."""

from __future__ import annotations

import hashlib
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from inference_ref.draft import load_draft
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.target import load_target
from mtp_train.data import load_prompts, prompt_ids
from mtp_train.serving import vllm_engine

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "heads" / "smollm2_135m"
CARD = json.loads((PUBLISHED / "card.json").read_text())


@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_files_are_the_cards(name):
    """What the card describes is what is in the repository, within the size a head may take."""
    head = CARD["heads"][name]
    weights = PUBLISHED / head["dir"] / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == head["sha256"]
    assert weights.stat().st_size <= 12 * 2**20


@pytest.mark.skipif(find_spec("vllm") is None, reason=f"vLLM is not installed: {vllm_engine.INSTALL}")
@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_head_serves_as_its_card_says(name, smollm2):
    head, check = CARD["heads"][name], CARD["heads"][name]["cpu_check"]
    directory = PUBLISHED / head["dir"]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    prompts = load_prompts([REPO / "data" / "mt_bench.jsonl"], limit=check["prompts"])
    ids = prompt_ids(tokenizer, [p.turns[0] for p in prompts])
    target = load_target(smollm2, "cpu", torch.float32)
    eos = sorted({tokenizer.eos_token_id, *target.cfg.eos_token_ids} - {None})
    k, new = check["k"], check["max_new_tokens"]
    ours = speculative_generate(target, load_draft(directory, target), ids, new, eos, Chain(k))
    tau = ours.stats.mean_accepted_len

    run = vllm_engine.Run(name, head=str(directory), k=k)  # the published files, as they are
    served = vllm_engine.run_vllm(smollm2, ids, new, eos, [run])[name]
    print(
        json.dumps(
            {"tau": tau, "ours": [ours.stats.tried, ours.stats.accepted], "vllm": served["num_drafts"]}
        )
    )
    assert served["num_drafts"] == ours.stats.tried[0]
    assert served["accepted_per_pos"] == list(ours.stats.accepted)
    assert tau == pytest.approx(check["tau"], abs=check["tolerance"])
