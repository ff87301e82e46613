"""Chat data: every input format, every error, and exact loss masks for ChatML and Llama-3 templates.

Masks are written out as the conversation's text cut into runs of unsupervised (0) and supervised
(1) tokens: the runs concatenate to the rendered text, so each boundary is checked by eye.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from mtp_train.config import DataConfig
from mtp_train.data import (
    Conversation,
    DataFormatError,
    check_holdout_unseen,
    encode,
    load_conversations,
    load_prompts,
    load_samples,
    prompt_ids,
)

# The official Meta-Llama-3-8B-Instruct chat template (tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": " 4 \n"},
]


@pytest.fixture(scope="module")
def chatml(smollm2):
    return AutoTokenizer.from_pretrained(str(smollm2))


@pytest.fixture(scope="module")
def llama3(chatml):
    """SmolLM2's tokenizer with the Llama-3 template only: its markers are plain text, several tokens each."""
    tok = copy.deepcopy(chatml)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama3_special(llama3):
    """As a real Llama-3 tokenizer: the markers are single special tokens and `<|eot_id|>` is EOS."""
    tok = copy.deepcopy(llama3)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        }
    )
    return tok


def runs(tokenizer, messages) -> list[tuple[str, int]]:
    """The sample's text as maximal runs of tokens with the same mask value."""
    sample = encode(tokenizer, [Conversation(messages, "t:1", "t:1")])[0]
    assert len(sample.input_ids) == len(sample.loss_mask)
    out: list[tuple[list[int], int]] = []
    for token, m in zip(sample.input_ids, sample.loss_mask):
        if out and out[-1][1] == m:
            out[-1][0].append(token)
        else:
            out.append(([token], m))
    return [(tokenizer.decode(ids), m) for ids, m in out]


def supervised_tokens(tokenizer, messages) -> list[str]:
    sample = encode(tokenizer, [Conversation(messages, "t:1", "t:1")])[0]
    return tokenizer.convert_ids_to_tokens([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


# --- exact masks -------------------------------------------------------------------------------


def test_chatml_single_turn_default_system_prompt(chatml):
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert runs(chatml, messages) == [
        (SMOL_SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n", 0),  # the separator after <|im_end|>: generation stops before it
    ]
    assert supervised_tokens(chatml, messages) == ["Hello", "!", "<|im_end|>"]


def test_chatml_multi_turn_with_system_prompt(chatml):
    assert runs(chatml, TWO_TURNS) == [
        (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        (" 4 \n<|im_end|>", 1),  # ChatML keeps the content verbatim
        ("\n", 0),
    ]
    assert supervised_tokens(chatml, TWO_TURNS) == ["Hello", "!", "<|im_end|>", "Ġ", "4", "ĠĊ", "<|im_end|>"]


def test_llama3_multi_turn_with_system_prompt(llama3_special):
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert runs(llama3_special, TWO_TURNS) == [
        (
            "<|begin_of_text|>"
            + header.format("system")
            + "Be brief.<|eot_id|>"
            + header.format("user")
            + "Hi there<|eot_id|>"
            + header.format("assistant"),
            0,
        ),
        ("Hello!<|eot_id|>", 1),
        (header.format("user") + "2+2?<|eot_id|>" + header.format("assistant"), 0),
        ("4<|eot_id|>", 1),  # the template trims the content
    ]
    assert supervised_tokens(llama3_special, TWO_TURNS) == ["Hello", "!", "<|eot_id|>", "4", "<|eot_id|>"]


def test_llama3_template_on_a_tokenizer_without_its_special_tokens(llama3):
    # Markers are plain text here. The end-of-turn text is supervised whole; BPE merges the last
    # '>' of `<|eot_id|>` with the next header's '<' into one token '><', which carries assistant
    # text and so is supervised too. BOS is SmolLM2's own (<|im_start|>).
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert runs(llama3, TWO_TURNS) == [
        (
            "<|im_start|>"
            + header.format("system")
            + "Be brief.<|eot_id|>"
            + header.format("user")
            + "Hi there<|eot_id|>"
            + header.format("assistant"),
            0,
        ),
        ("Hello!<|eot_id|><", 1),
        ("|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>" + header.format("assistant"), 0),
        ("4<|eot_id|>", 1),
    ]
    eot = ["<", "|", "e", "ot", "_", "id", "|"]
    assert supervised_tokens(llama3, TWO_TURNS) == ["Hello", "!", *eot, "><", "4", *eot, ">"]


def test_conversation_ending_on_a_user_turn_supervises_only_the_answers(chatml):
    messages = TWO_TURNS[:4]
    assert [text for text, m in runs(chatml, messages) if m] == ["Hello!<|im_end|>"]


def test_template_that_breaks_the_prefix_property_is_an_error(chatml):
    tok = copy.deepcopy(chatml)
    tok.chat_template = "{{ messages | length }}" + chatml.chat_template
    with pytest.raises(DataFormatError, match=r"conv\.jsonl:7: messages\[1\]: the chat template"):
        encode(tok, [Conversation(TWO_TURNS[1:3], "conv.jsonl:7", "x")])


def test_prompt_ids_end_with_the_generation_prompt(chatml):
    (ids,) = prompt_ids(chatml, [[{"role": "user", "content": "Hi"}]])
    assert chatml.decode(ids) == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# --- input formats -----------------------------------------------------------------------------


def write_jsonl(path, lines: list[str | dict]) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


RECORDS_AND_MESSAGES = [
    (
        {"id": "a", "messages": [{"role": "system", "content": "S"}, user("U"), assistant("A")]},
        [{"role": "system", "content": "S"}, user("U"), assistant("A")],
    ),
    (
        {
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "human", "value": "U"},
                {"from": "gpt", "value": "A"},
            ]
        },
        [{"role": "system", "content": "S"}, user("U"), assistant("A")],
    ),
    ({"prompt": "P"}, [user("P")]),
    ({"question": "Q"}, [user("Q")]),
    ({"question": "Q", "answer": "#### 4"}, [user("Q"), assistant("#### 4")]),
    ({"instruction": "I"}, [user("I")]),
    ({"instruction": "I", "input": "", "output": "O"}, [user("I"), assistant("O")]),
    ({"instruction": "I", "input": "X", "output": "O"}, [user("I\n\nX"), assistant("O")]),
    ({"question_id": 81, "category": "writing", "turns": ["T1", "T2"]}, [user("T1"), user("T2")]),
]


def test_jsonl_every_format_with_line_sources(tmp_path):
    lines = [r for r, _ in RECORDS_AND_MESSAGES]
    path = write_jsonl(tmp_path / "mixed.jsonl", [lines[0], "", *lines[1:]])  # a blank line 2
    convs = load_conversations([path])
    assert [c.messages for c in convs] == [m for _, m in RECORDS_AND_MESSAGES]
    assert [c.source for c in convs] == [f"{path}:{n}" for n in [1, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert convs[0].id == "a" and convs[-1].id == "81" and convs[1].id == f"{path}:3"


def test_parquet_save_to_disk_and_json_array_with_index_sources(tmp_path):
    # One Arrow table for all formats: unused columns are null and must not be read as present.
    records = [r for r, _ in RECORDS_AND_MESSAGES[2:8]]
    expected = [m for _, m in RECORDS_AND_MESSAGES[2:8]]
    columns = sorted({k for r in records for k in r})
    ds = datasets.Dataset.from_list([{k: r.get(k) for k in columns} for r in records])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "d.json").write_text(json.dumps(records, indent=1))
    for name in ["d.parquet", "saved", "saved_dict", "d.json"]:
        path = str(tmp_path / name)
        convs = load_conversations([path])
        assert [c.messages for c in convs] == expected, name
        assert [c.source for c in convs] == [f"{path}:{i}" for i in range(len(records))], name


def test_json_file_holding_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert [c.source for c in load_conversations([path])] == [f"{path}:1", f"{path}:2"]


# --- errors ------------------------------------------------------------------------------------

ERRORS = [
    ('{"prompt": "x"', r"invalid JSON"),
    ("[1, 2]", r"record: expected a JSON object, got list"),
    (
        {"text": "x", "meta": 1},
        r"record: unknown format, fields \['meta', 'text'\]; expected one of: messages.*conversations.*turns.*instruction.*question.*prompt",
    ),
    (
        {"messages": [user("u"), {"role": "bot", "content": "a"}]},
        r"messages\[1\]\.role: 'bot' is not one of system, user, assistant",
    ),
    (  # a list is no key of the role table: the same line, not a TypeError
        {"messages": [{"role": ["user"], "content": "x"}]},
        r"messages\[0\]\.role: \['user'\] is not one of system, user, assistant",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        r"messages\[0\]\.content: content must be a string, got list",
    ),
    (
        {"messages": [user("u"), {"role": "assistant"}]},
        r"messages\[1\]\.content: content must be a string, got NoneType",
    ),
    ({"messages": []}, r"messages: expected a non-empty list"),
    (
        {"conversations": [{"from": "gpt", "value": "a"}]},
        r"conversations\[0\]: a conversation cannot open with an assistant",
    ),
    ({"messages": ["hi"]}, r"messages\[0\]: expected an object with 'role' and 'content'"),
    (
        {"conversations": [{"from": "bob", "value": "x"}]},
        r"conversations\[0\]\.from: 'bob' is not one of system, human, user, gpt, assistant",
    ),
    (
        {"conversations": [{"from": "human", "value": 3}]},
        r"conversations\[0\]\.value: content must be a string, got int",
    ),
    ({"turns": ["a", 2]}, r"turns\[1\]: content must be a string, got int"),
    ({"question": "q", "answer": 4}, r"answer: content must be a string, got int"),
    ({"instruction": "i", "input": 5}, r"input: content must be a string, got int"),
]


@pytest.mark.parametrize("bad, message", ERRORS)
def test_error_names_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(DataFormatError, match=f"^{path}:2: {message}") as err:
        load_conversations([path])
    assert isinstance(err.value, ValueError)


def test_missing_assistant_is_an_error_when_required(tmp_path, chatml):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "a"}, {"question": "q"}])
    with pytest.raises(DataFormatError, match=f"^{path}:2: question: no assistant turn"):
        load_samples(DataConfig(train_files=[path]), chatml)
    _, counts = load_samples(DataConfig(train_files=[path], require_assistant=False), chatml)
    assert counts["samples"] == 1 and counts["unsupervised"] == 1


def test_error_in_parquet_names_record_index(tmp_path):
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(
        [{"messages": [user("u")]}, {"messages": [{"role": "bot", "content": "x"}]}]
    ).to_parquet(path)
    with pytest.raises(DataFormatError, match=rf"^{path}:1: messages\[0\]\.role: 'bot'"):
        load_conversations([path])


def test_a_torn_parquet_file_is_named(tmp_path):
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list([{"prompt": "a"}]).to_parquet(path)
    Path(path).write_bytes(Path(path).read_bytes()[:-12])  # the footer cut off, as a copy cut short
    with pytest.raises(DataFormatError, match=rf"^{path}: not a readable parquet file \("):
        load_conversations([path])


def test_unsupported_file_type(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match="x.csv: not a .jsonl"):
        load_conversations([str(tmp_path / "x.csv")])


# --- samples: lengths, splits ------------------------------------------------------------------


def test_truncate_and_drop_are_counted(tmp_path, chatml):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"question": "Hi", "answer": "Hello!"},  # fits
            {"question": "Hi", "answer": "word " * 100},  # long answer: truncated, still supervised
            {"question": "word " * 100, "answer": "ok"},  # long prompt: truncated before the answer
        ],
    )
    (short,) = encode(chatml, load_conversations([path])[:1])
    limit = len(short.input_ids) + 10
    samples, counts = load_samples(DataConfig(train_files=[path], max_seq_len=limit), chatml)
    assert counts == dict(
        records=3,
        samples=2,
        truncated=2,
        dropped=0,
        unsupervised=1,
        tokens=len(short.input_ids) + limit,
        supervised_tokens=sum(short.loss_mask) + sum(samples[1].loss_mask),
    )
    assert samples[0] == short and len(samples[1].input_ids) == limit
    # Same prompt as the short sample: its unsupervised tokens less the final "\n"; the rest is answer.
    prompt_len = len(short.input_ids) - sum(short.loss_mask) - 1
    assert sum(samples[1].loss_mask) == limit - prompt_len

    samples, counts = load_samples(DataConfig(train_files=[path], max_seq_len=limit, overlong="drop"), chatml)
    assert (counts["samples"], counts["truncated"], counts["dropped"], counts["unsupervised"]) == (1, 0, 2, 0)
    assert samples == [short]


def test_holdout_is_the_first_records_and_max_samples_counts_after_it(tmp_path, chatml):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(5)])
    cfg = DataConfig(train_files=[path, path], holdout=2, max_samples=6)
    held, counts = load_samples(cfg, chatml, split="holdout")
    assert [s.source for s in held] == [f"{path}:1", f"{path}:2"] and counts["records"] == 2
    train, _ = load_samples(cfg, chatml, split="train")
    assert [s.source for s in train] == [f"{path}:{n}" for n in [3, 4, 5, 1, 2, 3]]


def test_validation_refuses_set_aside_records_the_head_may_have_trained_on(tmp_path, monkeypatch):
    """data.holdout against the data the head trained on (a store's data config): the same files
    under another spelling pass when training skipped at least as many records; fewer skipped, or
    other files sharing one, are refused in one line naming where the training data is recorded."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").touch()
    trained = {"train_files": [str(tmp_path / "a.jsonl")], "holdout": 4}
    check_holdout_unseen(DataConfig(train_files=["./a.jsonl"], holdout=4), trained, "store S")
    check_holdout_unseen(DataConfig(train_files=["a.jsonl"], holdout=0), {"holdout": 0}, "store S")
    check_holdout_unseen(DataConfig(train_files=["b.jsonl"], holdout=9), trained, "store S")  # other files
    with pytest.raises(
        ValueError, match=r"^store S: made with data.holdout=4, so the head trained on records 4..5"
    ):
        check_holdout_unseen(DataConfig(train_files=["a.jsonl"], holdout=6), trained, "store S")
    with pytest.raises(ValueError, match=r"^store S: made from data.train_files=.*share .*a.jsonl"):
        check_holdout_unseen(DataConfig(train_files=["b.jsonl", "a.jsonl"], holdout=1), trained, "store S")


# --- prompts -----------------------------------------------------------------------------------


def test_evaluation_prompts_that_hold_none_are_refused_in_one_line(tmp_path):
    """Validation and the trainer call `eval_prompts` before the target loads: an empty file is
    named there, not met as an empty max() after the target-alone pass has started."""
    from mtp_train.config import ConfigError, ValidateConfig
    from mtp_train.validate.during_training import eval_prompts

    empty = tmp_path / "empty.jsonl"
    empty.touch()
    with pytest.raises(ConfigError, match=r"^validate.eval_files \[.*empty.jsonl'\] hold no prompt$"):
        eval_prompts(ValidateConfig(eval_files=[str(empty)]))
    path = write_jsonl(tmp_path / "p.jsonl", [{"turns": ["a"]}, {"turns": ["b"]}])
    assert [p.turns for p in eval_prompts(ValidateConfig(eval_files=[path], num_prompts=1))] == [
        [[user("a")]]
    ]


def test_load_prompts_cuts_conversations_to_user_turns(tmp_path):
    system = {"role": "system", "content": "S"}
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question_id": 81, "turns": ["T1", "T2"]},
            {"id": "m", "messages": [system, user("U1"), assistant("A1"), user("U2")]},
            {"question": "Q", "answer": "A"},
        ],
    )
    prompts = load_prompts([path])
    assert [p.id for p in prompts] == ["81", "m", f"{path}:3"]
    assert [p.turns for p in prompts] == [
        [[user("T1")], [user("T2")]],
        [[system, user("U1")], [user("U2")]],
        [[user("Q")]],
    ]
    assert len(load_prompts([path], limit=2)) == 2


def test_load_prompts_rejects_duplicate_ids_and_promptless_records(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}])
    with pytest.raises(DataFormatError, match=f"^{path}:2: id: '1' is also the id of {path}:1"):
        load_prompts([path])
    path = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "system", "content": "S"}]}])
    with pytest.raises(DataFormatError, match=f"^{path}:1: messages: no user turn"):
        load_prompts([path])
