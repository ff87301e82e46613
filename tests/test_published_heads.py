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
from inference_ref.target import eos_ids, load_target
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


@pytest.fixture(scope="module")
def served(smollm2):
    """Our loop and vLLM on every published head: the first turns of the cards' MT-bench questions,
    one vLLM child process for all the heads (one engine each: its start-up is most of the cost),
    serving them while our loop runs."""
    checks = {name: head["cpu_check"] for name, head in CARD["heads"].items()}
    prompts, new = {c["prompts"] for c in checks.values()}, {c["max_new_tokens"] for c in checks.values()}
    assert len(prompts) == len(new) == 1, "the cards' checks share their prompts and lengths"
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    questions = load_prompts([REPO / "data" / "mt_bench.jsonl"], limit=prompts.pop())
    ids = prompt_ids(tokenizer, [p.turns[0] for p in questions])
    target = load_target(smollm2, "cpu", torch.float32)
    eos = eos_ids(target, tokenizer)
    new = new.pop()
    runs = [  # the published files, as they are
        vllm_engine.Run(name, head=str(PUBLISHED / CARD["heads"][name]["dir"]), k=c["k"])
        for name, c in checks.items()
    ]
    engine = vllm_engine.start_vllm(smollm2, ids, new, eos, runs)  # vLLM serves while our loop runs
    with vllm_engine.leave_a_core():
        ours = {
            name: speculative_generate(
                target,
                load_draft(PUBLISHED / CARD["heads"][name]["dir"], target),
                ids,
                new,
                eos,
                Chain(c["k"]),
            ).stats
            for name, c in checks.items()
        }
    return ours, engine.result()


@pytest.mark.skipif(find_spec("vllm") is None, reason=f"vLLM is not installed: {vllm_engine.INSTALL}")
@pytest.mark.parametrize("name", sorted(CARD["heads"]))
def test_published_head_serves_as_its_card_says(name, served):
    check = CARD["heads"][name]["cpu_check"]
    ours, engine = served[0][name], served[1][name]
    tau = ours.mean_accepted_len
    print(json.dumps({"tau": tau, "ours": [ours.tried, ours.accepted], "vllm": engine["num_drafts"]}))
    assert engine["num_drafts"] == ours.tried[0]
    assert engine["accepted_per_pos"] == list(ours.accepted)
    # what the card (and the model card) says they count: fp32 on a CPU reproduces it exactly
    assert [ours.tried[0], list(ours.accepted)] == [
        check["counts"]["num_drafts"],
        check["counts"]["accepted_per_pos"],
    ]
    assert tau == pytest.approx(check["tau"], abs=check["tolerance"])
