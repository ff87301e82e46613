"""Batched cached generation equals transformers' `generate`, and sampling is reproducible."""

from __future__ import annotations

import pytest
import torch
import transformers

from inference_ref import generate as generate_module
from inference_ref.generate import generate, sample
from inference_ref.models.llama import load_llama

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one paragraph.",
    "hi",
    "List three prime numbers and say why each is prime.",
]


def chat_prompts(model_dir) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    render = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    return [r["input_ids"] for r in render]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, eos: list[int]) -> list[list[int]]:
    """transformers' greedy decoding of the batch (left-padded, as transformers pads), cut after EOS."""
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    return [cut_after_eos(row[width:].tolist(), eos) for row in out]


def cut_after_eos(tokens: list[int], eos: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


@pytest.mark.parametrize("which", ["smollm2", "tiny_target"])
def test_greedy_equals_transformers(which, request):
    model_dir = request.getfixturevalue(which)
    model = load_llama(model_dir)
    prompts = chat_prompts(model_dir)
    assert len({len(p) for p in prompts}) > 1  # batched with different lengths
    eos = list(model.cfg.eos_token_ids)
    ours = generate(model, prompts, 64, eos)
    assert ours == hf_greedy(model_dir, prompts, 64, eos)
    if which == "smollm2":  # real text: some rows stop at EOS, others at the limit
        assert {len(o) for o in ours} - {64} and any(len(o) == 64 for o in ours)
        assert all(o[-1] in eos for o in ours if len(o) < 64)


def test_sampling_is_reproducible(tiny_target):
    model = load_llama(tiny_target)
    prompts = chat_prompts(tiny_target)[:3]
    eos = list(model.cfg.eos_token_ids)

    def run(seed: int) -> list[list[int]]:
        return generate(
            model, prompts, 16, eos, temperature=1.0, generator=torch.Generator().manual_seed(seed)
        )

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    assert first != generate(model, prompts, 16, eos)  # T = 1 on a random model is far from greedy


def test_eos_stops_a_row_and_is_included(tiny_target):
    model = load_llama(tiny_target)
    prompts = chat_prompts(tiny_target)[:2]
    greedy = generate(model, prompts, 12, [])
    stop = greedy[0][5]  # pretend the 6th greedy token of row 0 is an end-of-sequence token
    out = generate(model, prompts, 12, [stop])
    for full, cut in zip(greedy, out):
        n = full.index(stop) + 1 if stop in full else len(full)
        assert cut == full[:n]


def stops_early(greedy: list[list[int]], rows: int) -> list[int]:
    """End-of-sequence ids that stop the first `rows` greedy rows after 2–4 tokens (and maybe others)."""
    return [row[2 + b % 3] for b, row in enumerate(greedy[:rows])]


def test_finished_rows_leave_the_batch_and_the_rest_decode_the_same(smollm2, monkeypatch):
    """`compact`: once half the rows are done the step runs on the others only; every row's tokens
    are the ones the full batch decodes (real text: the tiny model repeats one token)."""
    model = load_llama(smollm2)
    prompts = chat_prompts(smollm2)
    eos = stops_early(generate(model, prompts, 24, []), 3)
    plain = generate(model, prompts, 24, eos)
    assert sorted(map(len, plain))[2] < max(map(len, plain))  # 3 of 5 done while others decode
    batches = []

    def spy(model, cache, **kw):
        batches.append(cache.lengths.shape[0])
        return decode_step(model, cache, **kw)

    decode_step = generate_module.DecodeStep
    monkeypatch.setattr(generate_module, "DecodeStep", spy)
    assert generate(model, prompts, 24, eos, compact=True) == plain
    assert batches[0] == len(prompts) and batches[-1] <= len(prompts) // 2


def test_sample_at_temperature_zero_is_argmax():
    logits = torch.randn(3, 4, 50)
    assert torch.equal(sample(logits, 0.0, None), logits.argmax(-1))
    drawn = sample(logits, 0.5, torch.Generator().manual_seed(0))
    assert drawn.shape == (3, 4) and drawn.dtype == torch.long


def test_decoding_ahead_equals_the_synchronous_loop(smollm2):
    """The host a step behind (`decode_ahead`, the loop without `stop_repeat` or `compact`) gives the
    synchronous loop's tokens, commits and kept states, rows stopping at an EOS and at the limit
    (real text: the tiny model repeats one token)."""
    from inference_ref.generate import States

    model = load_llama(smollm2)
    prompts = chat_prompts(smollm2)
    eos = stops_early(generate(model, prompts, 10, []), 2)
    never = 10**6  # a stop_repeat that never fires: the synchronous loop
    ahead, synchronous = States(capture=(1,), room=3), States(capture=(1,), room=3)
    out = generate(model, prompts, 10, eos, states=ahead)
    assert out == generate(model, prompts, 10, eos, states=synchronous, stop_repeat=never)
    assert {len(o) for o in out} - {10} and any(len(o) == 10 for o in out)
    assert torch.equal(ahead.cache.lengths, synchronous.cache.lengths)
    for b, o in enumerate(out):
        fed = len(prompts[b]) + len(o) - 1
        assert torch.equal(ahead.row(b, fed), synchronous.row(b, fed))
