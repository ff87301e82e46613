"""The store written while regenerating (`regenerate.capture`) is the store precompute writes from the
regenerated conversations: the same samples, token ids and loss masks, states equal to bf16
rounding, the same manifest; precompute then finds it complete; a killed run resumes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import mtp_train.regenerate as regen
from inference_ref.generate import generate
from mtp_train.capture import StoreCapture
from mtp_train.config import ConfigError
from mtp_train.precompute import run_precompute
from mtp_train.regenerate import regenerate
from mtp_train.run import Target
from mtp_train.store import Store
from mtp_train.target_files import write_random_target
from tiny import recipe

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    {"question_id": 81, "turns": ["Name a fruit.", "And a vegetable?"]},  # turn 2 sees turn 1
    {
        "id": "sys",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    },
    {"id": "long", "prompt": "word " * 300},  # over max_prompt_tokens: skipped
    *({"prompt": f"Question {i}: what is {i} + {i}?" + " Think." * (i % 4)} for i in range(12)),
]


@pytest.fixture(scope="module")
def chatty_target(smollm2, tmp_path_factory):
    """A random 2-layer Llama whose lm_head knows three tokens (" the", " a", <|im_end|>): its answers
    decode to text that tokenizes back to the same ids, some end with <|im_end|>, some run to
    max_new_tokens, and some hold <|endoftext|> (all logits 0 but the three): a random target's
    answers would almost all tokenize otherwise, and exercise only the fallback."""
    out = write_random_target(tmp_path_factory.mktemp("chatty"), smollm2, seed=0, tie_word_embeddings=False)
    weights = load_file(str(out / "model.safetensors"))
    head = torch.zeros_like(weights["lm_head.weight"])
    g = torch.Generator().manual_seed(14)  # a seed giving the mix above on these prompts
    for token in (260, 253, 2):
        head[token] = torch.randn(head.shape[1], generator=g)
    head[2] *= 0.8
    weights["lm_head.weight"] = head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def config(target: Path, tmp_path: Path, *extra: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    cfg = recipe(
        [
            "model=tiny_random",
            f"model.target={target}",
            "model.dtype=float32",
            f"run_dir={tmp_path / 'run'}",
            f"regenerate.prompts=[{prompts}]",
            "regenerate.max_new_tokens=8",
            "regenerate.max_prompt_tokens=96",
            "regenerate.batch_size=4",
            "regenerate.capture=true",
            "data.train_files=[${regenerate.output}]",
            "data.max_seq_len=60",  # some conversations are truncated
            "precompute.shard_tokens=128",  # several shards
            *extra,
        ]
    )
    OmegaConf.resolve(cfg)
    return cfg


def run_regenerate(cfg) -> tuple[dict, StoreCapture]:
    capture = StoreCapture(cfg, Target.resolve(cfg.model.target), torch.float32)
    counts = regenerate(cfg.regenerate, cfg.model.target, capture=capture)
    return counts, capture


def precomputed(cfg) -> Store:
    """The store precompute writes from the same regenerated jsonl, elsewhere."""
    cfg = cfg.copy()
    cfg.precompute.store_dir = str(Path(cfg.run_dir) / "precomputed")
    return Store(run_precompute(cfg))


def assert_same_store(got: Store, want: Store, step: float = 2**-7) -> None:
    """`step`: the stored dtype's relative rounding step (bf16's; e4m3's is 2^-3)."""
    assert len(got) == len(want) > 0
    by_id = {int(k): i for i, k in enumerate(want.sample_ids)}
    for i, k in enumerate(got.sample_ids):
        ids, mask, hidden = got.sample(i)
        want_ids, want_mask, want_hidden = want.sample(by_id[int(k)])
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask), int(k)
        # fp32 states from the KV-cache path and the packed path, both rounded as stored: one step
        torch.testing.assert_close(hidden.float(), want_hidden.float(), rtol=step, atol=1e-5)
    shard_fields = ("shards", "fp8_rel_rms_error")
    strip = lambda m: {k: v for k, v in m.items() if k not in shard_fields}  # noqa: E731
    assert strip(got.manifest) == strip(want.manifest)


def test_the_store_written_while_regenerating_is_precomputes(chatty_target, tmp_path, monkeypatch):
    cfg = config(chatty_target, tmp_path)
    counts, capture = run_regenerate(cfg)
    assert counts["written"] == len(PROMPTS) - 1 and counts["skipped"] == 1
    store = Store(cfg.precompute.store_dir)
    assert capture.captured >= len(store) - 2 and capture.forwarded <= 2
    answers = [json.loads(line)["messages"][-1]["content"] for line in open(cfg.regenerate.output)]
    assert any(a.endswith(("the", "a")) for a in answers)  # answers cut at max_new_tokens: a 3-token tail
    assert_same_store(store, precomputed(cfg))

    # precompute finds the store complete, and a rerun of the regeneration leaves it as it is
    monkeypatch.setattr("mtp_train.precompute.load_target", None)  # the target is not needed
    assert run_precompute(cfg) == Path(cfg.precompute.store_dir)
    before = (Path(cfg.precompute.store_dir) / "manifest.json").read_text()
    monkeypatch.setattr(regen, "load_target", None)
    assert run_regenerate(cfg)[0]["written"] == 0
    assert (Path(cfg.precompute.store_dir) / "manifest.json").read_text() == before


def test_a_killed_capture_resumes_and_precompute_refuses_it_meanwhile(chatty_target, tmp_path, monkeypatch):
    # fp8, and shards larger than what is answered before the kill: some answers are not in one yet
    cfg = config(chatty_target, tmp_path, "precompute.hidden_dtype=fp8", "precompute.shard_tokens=400")
    calls = []

    def dies_on_fourth_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(regen, "generate", dies_on_fourth_call)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(cfg)
    with pytest.raises(ValueError, match="rerun mtp_train.regenerate with regenerate.capture=true"):
        run_precompute(cfg)
    monkeypatch.setattr(regen, "generate", generate)
    counts, capture = run_regenerate(cfg)
    assert counts["already_done"] > 0 and counts["written"] > 0
    assert capture.forwarded > 0  # answered before the kill, not yet in a committed shard
    assert_same_store(Store(cfg.precompute.store_dir), precomputed(cfg), step=2**-3)


def test_capture_needs_the_regenerated_file_as_the_data(tiny_target, tmp_path):
    cfg = config(tiny_target, tmp_path, f"data.train_files=[{REPO / 'tests' / 'data' / 'gsm8k_64.jsonl'}]")
    with pytest.raises(ConfigError, match=r"data.train_files=\["):
        StoreCapture(cfg, Target.resolve(cfg.model.target), torch.float32)


def test_answers_stop_at_a_loop_and_the_store_still_is_precomputes(chatty_target, tmp_path):
    """`regenerate.stop_repeat`: an answer stops where its last n tokens repeat an earlier n-gram
    of it (the chatty target's answers, made of three tokens, loop soon), the states kept for it
    stop there too, and the store still equals precompute's of the written answers."""
    from inference_ref.generate import generate
    from inference_ref.target import load_target

    said: list[str] = []
    model = load_target(chatty_target, say=said.append)
    (line,) = said  # the load is announced, with the checkpoint's size
    assert re.fullmatch(
        rf"loading the target {re.escape(str(chatty_target))} \([\d.]+ GB on disk\) onto cpu", line
    )
    prompts = [[1, 4093, 198, 260], [1, 4093, 198, 253, 253], [1, 4093]]
    full = generate(model, prompts, 24, [])
    cut = generate(model, prompts, 24, [], stop_repeat=3)
    for f, c in zip(full, cut):
        assert f[: len(c)] == c  # a prefix of the uncut answer
        grams = [tuple(c[i : i + 3]) for i in range(len(c) - 2)]
        assert len(set(grams[:-1])) == len(grams) - 1  # no repeat before the last trigram …
        assert len(c) == 24 or grams[-1] in grams[:-1]  # … which repeats an earlier one

    cfg = config(chatty_target, tmp_path, "regenerate.stop_repeat=3", "regenerate.max_new_tokens=16")
    counts, _ = run_regenerate(cfg)
    assert counts["looped"] > 0 and counts["written"] == len(PROMPTS) - 1
    assert_same_store(Store(cfg.precompute.store_dir), precomputed(cfg))
