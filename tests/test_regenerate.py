"""Self-distillation on the tiny random target: output format, multi-turn order, kill and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import mtp_train.regenerate as regen
from inference_ref.generate import generate
from inference_ref.models.llama import load_llama
from mtp_train.config import DataConfig, RegenerateConfig
from mtp_train.data import load_samples, prompt_ids
from mtp_train.regenerate import Counts, answer_text, regenerate

REPO = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "Be brief."}
PROMPTS = [
    {"question_id": 81, "turns": ["Name a fruit.", "And a vegetable?"]},
    {
        "id": "sys",
        "messages": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OLD"}],
    },
    {"question": "What is 2 + 2?", "answer": "#### 4"},
    {"prompt": "Write a haiku about the sea, please, in the style of an old sailor."},
    {"instruction": "Sort these numbers.", "input": "3 1 2"},
    {"id": "long", "prompt": "word " * 300},
]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return str(path)


def config(prompts_file, tmp_path, **kw) -> RegenerateConfig:
    defaults = dict(max_new_tokens=3, batch_size=2, max_prompt_tokens=128)
    return RegenerateConfig(
        prompts=[prompts_file], output=str(tmp_path / "out" / "regen.jsonl"), **{**defaults, **kw}
    )


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_a_static_fp8_target_is_refused_before_anything_is_read(tiny_target, prompts_file, tmp_path):
    """Only precompute calibrates static FP8 input scales (tests/test_precompute.py)."""
    cfg = config(prompts_file, tmp_path)
    with pytest.raises(
        ValueError, match="fp8_static: regeneration does not calibrate.*model.quantization=fp8"
    ):
        regenerate(cfg, tiny_target, quantization="fp8_static")
    assert not (tmp_path / "out").exists()


def test_output_format_and_multi_turn_order(tiny_target, prompts_file, tmp_path):
    cfg = config(prompts_file, tmp_path)
    counts = regenerate(cfg, tiny_target)
    records = {r["id"]: r for r in read(cfg.output)}
    assert counts["written"] == 5 and counts["skipped"] == 1  # "long" is over max_prompt_tokens
    assert sorted(records) == sorted(
        ["81", "sys", f"{prompts_file}:3", f"{prompts_file}:4", f"{prompts_file}:5"]
    )
    assert counts["new_tokens"] <= 3 * 6  # six answers (MT-bench has two turns) of at most 3 tokens
    for r in records.values():
        assert set(r) == {"id", "source", "messages"}
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in r["messages"])
        assert r["messages"][-1]["role"] == "assistant" and "<|im_end|>" not in r["messages"][-1]["content"]
    assert records["81"]["source"] == f"{prompts_file}:1"
    assert [m["role"] for m in records["81"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in records["81"]["messages"][::2]] == ["Name a fruit.", "And a vegetable?"]
    sys_msgs = records["sys"]["messages"]
    assert sys_msgs[:2] == [SYSTEM, {"role": "user", "content": "Hi"}] and sys_msgs[2]["content"] != "OLD"
    # The output is training data: it loads, and every sample has supervised tokens.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    _, data_counts = load_samples(DataConfig(train_files=[cfg.output]), tokenizer)
    assert data_counts["samples"] == 5


def test_turn_two_sees_the_targets_own_answer_to_turn_one(tiny_target, prompts_file, tmp_path):
    cfg = config(prompts_file, tmp_path, batch_size=1, limit=1)
    regenerate(cfg, tiny_target)
    (record,) = read(cfg.output)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    model = load_llama(tiny_target)
    eos = sorted(set(model.cfg.eos_token_ids) | {tokenizer.eos_token_id})
    for turn in (1, 3):  # greedy, one conversation per batch: exactly the direct call
        ids = prompt_ids(tokenizer, [record["messages"][:turn]])
        (new,) = generate(model, ids, 3, eos)
        assert record["messages"][turn]["content"] == tokenizer.decode(new)


def test_answer_text_drops_the_eos_and_counts_unfinished(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    hello = tokenizer("Hello!", add_special_tokens=False)["input_ids"]
    counts = Counts()
    assert answer_text(tokenizer, hello + [2], {2}, counts, limit=8) == "Hello!"
    assert answer_text(tokenizer, hello, {2}, counts, limit=len(hello)) == "Hello!"
    assert answer_text(tokenizer, hello, {2}, counts, limit=8) == "Hello!"  # stopped short: a loop
    assert (counts.unfinished, counts.new_tokens) == (1, 3 * len(hello) + 1)


def test_limit_then_resume_writes_everything_once(tiny_target, prompts_file, tmp_path):
    cfg = config(prompts_file, tmp_path, limit=3)
    assert regenerate(cfg, tiny_target)["written"] == 3
    first = read(cfg.output)
    cfg.limit = None
    counts = regenerate(cfg, tiny_target)
    assert (counts["already_done"], counts["written"], counts["skipped"]) == (3, 2, 1)
    records = read(cfg.output)
    assert records[:3] == first
    assert sorted(r["id"] for r in records) == sorted({r["id"] for r in records}) and len(records) == 5


def test_killed_run_resumes_without_duplicates_or_losses(tiny_target, prompts_file, tmp_path, monkeypatch):
    calls = []

    def dies_on_third_call(*args, **kwargs):
        calls.append(1)
        # Longest first: batch 1 is the haiku and the instruction (one call), batch 2 the question
        # and MT-bench, which dies after answering turn 1, in flight.
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    cfg = config(prompts_file, tmp_path)
    monkeypatch.setattr(regen, "generate", dies_on_third_call)
    with pytest.raises(KeyboardInterrupt):
        regenerate(cfg, tiny_target)
    survived = read(cfg.output)
    assert len(survived) == 2  # the first batch, complete
    with open(cfg.output, "a") as f:
        f.write('{"id": "torn", "messa')  # a kill in the middle of a write
    monkeypatch.setattr(regen, "generate", generate)
    counts = regenerate(cfg, tiny_target)
    assert (counts["already_done"], counts["written"]) == (2, 3)
    records = read(cfg.output)
    assert records[:2] == survived
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 5 and "torn" not in ids
    assert regenerate(cfg, tiny_target)["written"] == 0


def test_resume_follows_a_moved_prompt_file_and_refuses_changed_lines(tiny_target, tmp_path):
    """Records without an id are known by `file:line`: the same file in another folder (or spelled
    ./, or absolute) resumes where it stopped; a line inserted above answered ones is refused in one
    line, rather than taking each answered record for the prompt now on its line."""
    lines = [json.dumps({"prompt": f"Say {w}."}) + "\n" for w in ("one", "two", "three")]
    first = tmp_path / "a" / "p.jsonl"
    first.parent.mkdir()
    first.write_text("".join(lines))
    cfg = config(str(first), tmp_path, limit=2)
    assert regenerate(cfg, tiny_target)["written"] == 2
    moved = tmp_path / "b" / "p.jsonl"
    moved.parent.mkdir()
    moved.write_text("".join(lines))
    counts = regenerate(replace(cfg, prompts=[str(moved)], limit=None), tiny_target)
    assert (counts["already_done"], counts["written"]) == (2, 1)
    assert [r["id"] for r in read(cfg.output)] == [f"{first}:1", f"{first}:2", f"{moved}:3"]
    moved.write_text(json.dumps({"prompt": "Inserted."}) + "\n" + "".join(lines))
    with pytest.raises(
        ValueError, match=rf"^{cfg.output}:3: record '{moved}:3' answers other turns than prompt"
    ):
        regenerate(replace(cfg, prompts=[str(moved)], limit=None), tiny_target)
    assert len(read(cfg.output)) == 3  # nothing written


def test_answers_holding_line_separators_resume(tiny_target, tmp_path):
    """U+2028 and NEL stay raw in the output (ensure_ascii=False); resuming must not split there."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "first\u2028second\x85third"}) + "\n", encoding="utf-8")
    cfg = config(str(path), tmp_path)
    assert regenerate(cfg, tiny_target)["written"] == 1
    assert "\u2028" in Path(cfg.output).read_text(encoding="utf-8")
    assert regenerate(cfg, tiny_target)["written"] == 0
    with open(cfg.output, "a", encoding="utf-8") as f:
        f.write("{not json}\n")
    with pytest.raises(ValueError, match=rf"^{cfg.output}:2: invalid JSON"):
        regenerate(cfg, tiny_target)


def test_a_second_run_on_the_same_output_is_refused(tiny_target, prompts_file, tmp_path):
    from mtp_train.locks import Busy, exclusive

    cfg = config(prompts_file, tmp_path)
    out = Path(cfg.output)
    with exclusive(out.parent, "regenerate.output", lock_name=f".{out.name}.lock"):  # as a run would
        with pytest.raises(Busy, match=f"pid {os.getpid()} .*regenerate.output"):
            regenerate(cfg, tiny_target)
        assert not out.exists()
        # the lock is the file's: another output in the same folder goes ahead
        other = replace(cfg, output=str(out.parent / "other.jsonl"), limit=1)
        assert regenerate(other, tiny_target)["written"] == 1


def test_command_line(tiny_target, prompts_file, tmp_path):
    out = tmp_path / "cli.jsonl"
    args = [
        "model=tiny_random",
        f"model.target={tiny_target}",
        f"run_dir={tmp_path}",
        f"regenerate.prompts=[{prompts_file}]",
        f"regenerate.output={out}",
        "regenerate.max_new_tokens=2",
        "regenerate.max_prompt_tokens=128",
        "regenerate.temperature=1.0",
    ]
    subprocess.run([sys.executable, "-m", "mtp_train.regenerate", *args], check=True, capture_output=True)
    assert len(read(out)) == 5


def test_compile_option_reaches_the_target_and_is_ignored_on_cpu(
    tiny_target, prompts_file, tmp_path, monkeypatch
):
    """`regenerate.compile` is passed to `load_target`, which compiles the layers only on CUDA: on
    this CPU the target runs eager whatever is asked."""
    asked = []
    load = regen.load_target

    def recording_load(path, device, dtype, compile=False, quantization="none", tp_mesh=None, say=None):
        asked.append(compile)
        model = load(path, device, dtype, compile, quantization, tp_mesh, say=say)
        assert not model.compiled_layers
        return model

    monkeypatch.setattr(regen, "load_target", recording_load)
    regenerate(config(prompts_file, tmp_path, limit=1, compile=True), tiny_target)
    regenerate(config(prompts_file, tmp_path / "off", limit=1), tiny_target)
    assert asked == [True, False]


def test_parts_left_by_a_killed_run_are_kept_and_merged_once(tiny_target, prompts_file, tmp_path):
    """A run of several groups killed before its merge left part files (one with a torn line): a
    rerun skips their ids, answers the rest, and moves them into the output once."""
    cfg = config(prompts_file, tmp_path)
    regenerate(cfg, tiny_target)
    reference = read(cfg.output)
    out = Path(cfg.output)
    out.write_text("".join(json.dumps(r) + "\n" for r in reference[:1]))
    (tmp_path / "out/regen.jsonl.part0").write_text(
        json.dumps(reference[0]) + "\n" + json.dumps(reference[1]) + "\n"
    )
    (tmp_path / "out/regen.jsonl.part1").write_text(json.dumps(reference[2]) + '\n{"id": "torn", "mess')
    counts = regenerate(cfg, tiny_target)
    assert (counts["already_done"], counts["written"]) == (3, 2)
    assert not list(out.parent.glob("*.part*"))
    records = read(out)
    # the output's record, this run's answers (one group writes to the output itself), then the
    # parts' records in part order
    assert records[0] == reference[0] and records[-2:] == reference[1:3]
    assert sorted(map(json.dumps, records)) == sorted(map(json.dumps, reference))


def test_groups_split_the_prompts_and_write_what_one_process_writes(tiny_target, prompts_file, tmp_path):
    """Launched as 4 processes with model.tp_size=2 (two groups of two sharded ranks: the plain
    data-parallel case's dealing and writing, and the sharded target's), the groups deal the prompts
    between them and the output is one process's, line for line; no part file is left."""
    processes, tp = 4, 2
    common = [
        "model=tiny_random",
        f"model.target={tiny_target}",
        "model.dtype=float32",
        f"run_dir={tmp_path}",
        f"regenerate.prompts=[{prompts_file}]",
        "regenerate.max_new_tokens=3",
        "regenerate.max_prompt_tokens=128",
        "regenerate.batch_size=2",
    ]
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = dict(cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = subprocess.run(
        [sys.executable, "-m", "mtp_train.regenerate", *common, f"regenerate.output={one}"], **run
    )
    assert out.returncode == 0, out.stderr
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
    ]
    launched = [
        *torchrun,
        "-m",
        "mtp_train.regenerate",
        *common,
        f"regenerate.output={many}",
        f"model.tp_size={tp}",
    ]
    out = subprocess.run(launched, **run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert many.read_text() == one.read_text() and len(read(many)) == 5
    assert not list(tmp_path.glob("many.jsonl.part*"))
    assert "'written': 5" in out.stdout  # the groups' counts summed


def test_capture_refuses_several_processes(tiny_target, prompts_file, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "regen.jsonl"
    args = [
        "model=tiny_random",
        f"model.target={tiny_target}",
        f"run_dir={tmp_path}",
        f"regenerate.prompts=[{prompts_file}]",
        f"regenerate.output={out}",
        f"data.train_files=[{out}]",
        "regenerate.capture=true",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*torchrun, "-m", "mtp_train.regenerate", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert (
        "regenerate.capture writes the store from one process, 2 were launched"
        in result.stdout + result.stderr
    )
    assert not out.exists()
