"""Chat data: read conversation files, normalize them, render them with the target's chat template.

Accepted records (the format is detected per record, by the first of these fields present):
OpenAI `messages` (role/content), ShareGPT `conversations` (from/value), MT-bench `turns`
(user turns only), `instruction` (+ `input`, + `output`), `question` (+ `answer`, as GSM8K), `prompt` (+ `completion`).
Every conversation keeps where it came from as `file:N`: the 1-based line of a jsonl file, else the
record's 0-based index (what `dataset[N]` takes).

The loss mask is derived from the template's own rendering, never from header strings: each
assistant turn is located as the text between the rendering of the messages before it (with the
generation prompt) and the rendering that includes it. Inside that span, supervision ends at the
last end-of-turn (EOS) token, so a separator the template writes after it (ChatML's newline) is not
learned: serving stops at the EOS and never generates it.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain, islice
from pathlib import Path

import datasets

from mtp_train.config import ConfigError, DataConfig

Message = dict[str, str]

ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
FORMATS = ("messages", "conversations", "turns", "instruction", "question", "prompt")
ACCEPTED = (
    "messages (role/content), conversations (from/value), turns, "
    "instruction (+input, +output), question (+answer), prompt (+completion)"
)
TOKENIZE_CHUNK = 1024  # conversations tokenized per call: the Rust tokenizer parallelizes inside a call


class DataFormatError(ValueError):
    """A record, file or chat template that cannot become training data; the message names file:N and field."""


def _error(source: str, field: str, problem: str) -> DataFormatError:
    return DataFormatError(f"{source}: {field}: {problem}")


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    """Normalized turns: {"role": system|user|assistant, "content": str}."""
    source: str
    """`file:N` of the record."""
    id: str
    """The record's `id` (or `question_id`), else its source."""


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    """The rendered conversation's tokens."""
    loss_mask: list[int]
    """1 where the token is supervised (assistant content and its end-of-turn token)."""
    source: str
    """`file:N` of the record."""


@dataclass(frozen=True)
class Prompt:
    id: str
    """Record id; regeneration resumes by it."""
    source: str
    """`file:N` of the record."""
    turns: list[list[Message]]
    """Messages to append before each answer; each group ends with the user message to answer."""
    category: str | None = None
    """The record's `category` where it has one (MT-bench's writing, roleplay, …): validation
    reports acceptance per category."""


# --- reading files ----------------------------------------------------------------------------


def iter_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(source, record) for each record of a jsonl/json/parquet file or a `save_to_disk` directory."""
    path = Path(path)
    if not path.exists():
        raise DataFormatError(f"{path}: no such file or directory")
    if path.is_dir():
        yield from _dataset_records(path, _from_disk(path))
    elif path.suffix == ".parquet":
        yield from _dataset_records(path, _parquet(path))
    elif path.suffix in (".jsonl", ".json"):
        yield from _json_records(path)
    else:
        raise DataFormatError(f"{path}: not a .jsonl, .json or .parquet file, nor a save_to_disk directory")


def _parquet(path: Path) -> datasets.Dataset:
    try:
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    except ValueError as e:  # pyarrow's ArrowInvalid for a torn or foreign file: its text names no file
        raise DataFormatError(f"{path}: not a readable parquet file ({e})") from e


def _from_disk(path: Path) -> datasets.Dataset:
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataFormatError(f"{path}: a DatasetDict without a 'train' split (has {list(ds)})")
        ds = ds["train"]
    return ds


def _dataset_records(path: Path, ds: datasets.Dataset) -> Iterator[tuple[str, dict]]:
    for index, record in enumerate(ds):
        yield f"{path}:{index}", record


def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    # Parsed here rather than by `datasets`: its JSON builder infers one Arrow schema per file and
    # fails on heterogeneous or malformed records without saying which line.
    # Read as bytes and decoded line by line, so that a byte that is not UTF-8 is reported with its line.
    with path.open("rb") as f:
        starts_array = f.read(4096).lstrip().startswith(b"[")
        f.seek(0)
        if starts_array:
            yield from _json_array(path, _decoded(path, f.read()))
            return
        for lineno, raw in enumerate(f, 1):
            line = _decoded(f"{path}:{lineno}", raw)
            if line.strip():
                yield f"{path}:{lineno}", parse_object(f"{path}:{lineno}", line)


def _decoded(source, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        where = f"{source}:{line}" if isinstance(source, Path) else str(source)
        raise DataFormatError(
            f"{where}: not UTF-8 (byte {raw[e.start : e.start + 1]!r} at offset {e.start}); re-encode the file as UTF-8"
        ) from None


def _json_array(path: Path, text: str) -> Iterator[tuple[str, dict]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise _error(f"{path}:{index}", "record", f"expected a JSON object, got {type(record).__name__}")
        yield f"{path}:{index}", record


def parse_object(source: str, line: str) -> dict:
    """One JSON line's object, or one line naming `source` (file:line) and what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{source}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise _error(source, "record", f"expected a JSON object, got {type(record).__name__}")
    return record


def iter_all(files: Iterable[str | Path]) -> Iterator[tuple[str, dict]]:
    """Records of several files, in order."""
    return chain.from_iterable(iter_records(f) for f in files)


# --- normalizing records ----------------------------------------------------------------------


def to_conversation(record: dict, source: str, require_assistant: bool = False) -> Conversation:
    """Normalize one record of any accepted format to role/content messages."""
    # `is not None`: a parquet/Arrow file holding several formats has every column, null where unused.
    fmt = next((f for f in FORMATS if record.get(f) is not None), None)
    if fmt is None:
        present = sorted(k for k, v in record.items() if v is not None)
        raise _error(source, "record", f"unknown format, fields {present}; expected one of: {ACCEPTED}")
    messages = _READERS[fmt](record, source)
    if messages[0]["role"] == "assistant":  # only `messages`/`conversations` can open with one
        raise _error(
            source, f"{fmt}[0]", "a conversation cannot open with an assistant turn: nothing to answer"
        )
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise _error(source, fmt, "no assistant turn to supervise (data.require_assistant is set)")
    record_id = record.get("id", record.get("question_id"))
    return Conversation(messages, source, source if record_id is None else str(record_id))


def _text(source: str, field: str, value) -> str:
    if not isinstance(value, str):
        raise _error(source, field, f"content must be a string, got {type(value).__name__}")
    return value


def _items(source: str, field: str, value) -> list:
    if not isinstance(value, list) or not value:
        raise _error(source, field, f"expected a non-empty list, got {value!r:.60}")
    return value


def _turns_of(
    record: dict, source: str, field: str, role_key: str, text_key: str, roles: dict
) -> list[Message]:
    out = []
    for i, item in enumerate(_items(source, field, record[field])):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise _error(source, where, f"expected an object with {role_key!r} and {text_key!r}")
        role = item.get(role_key)
        if not isinstance(role, str) or role not in roles:  # a list or object is no dict key
            raise _error(source, f"{where}.{role_key}", f"{role!r} is not one of {', '.join(roles)}")
        out.append({"role": roles[role], "content": _text(source, f"{where}.{text_key}", item.get(text_key))})
    return out


def _user_then_answer(record: dict, source: str, question: str, answer: str) -> list[Message]:
    messages = [{"role": "user", "content": _text(source, question, record[question])}]
    if record.get(answer) is not None:
        messages.append({"role": "assistant", "content": _text(source, answer, record[answer])})
    return messages


def _instruction(record: dict, source: str) -> list[Message]:
    messages = _user_then_answer(record, source, "instruction", "output")
    extra = record.get("input")
    if extra:  # Alpaca convention: the input follows the instruction after a blank line
        messages[0]["content"] += "\n\n" + _text(source, "input", extra)
    return messages


def _mt_bench_turns(record: dict, source: str) -> list[Message]:
    turns = _items(source, "turns", record["turns"])
    return [{"role": "user", "content": _text(source, f"turns[{i}]", t)} for i, t in enumerate(turns)]


_READERS = {
    "messages": lambda r, s: _turns_of(r, s, "messages", "role", "content", ROLES),
    "conversations": lambda r, s: _turns_of(r, s, "conversations", "from", "value", SHAREGPT_ROLES),
    "turns": _mt_bench_turns,
    "instruction": _instruction,
    "question": lambda r, s: _user_then_answer(r, s, "question", "answer"),
    "prompt": lambda r, s: _user_then_answer(r, s, "prompt", "completion"),
}


def load_conversations(files: Iterable[str | Path], require_assistant: bool = False) -> list[Conversation]:
    """Every record of `files`, normalized."""
    return [to_conversation(r, s, require_assistant) for s, r in iter_all(files)]


# --- rendering and masking --------------------------------------------------------------------


def render(tokenizer, messages: list[Message], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_spans(tokenizer, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn, the character span the template gives it."""
    text = render(tokenizer, conv.messages)
    spans = []
    for k, message in enumerate(conv.messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, conv.messages[:k], add_generation_prompt=True)
        through = render(tokenizer, conv.messages[: k + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise _error(
                conv.source,
                f"messages[{k}]",
                "the chat template does not render this conversation's beginning as a prefix of it "
                "(with the generation prompt before the assistant turn), so the turn cannot be located",
            )
        spans.append((len(before), len(through)))
    return text, spans


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans, stop_ids: set[int]) -> list[int]:
    mask = [0] * len(ids)
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    for start, end in spans:
        # Tokens overlapping the span; one straddling its edge carries assistant text, so it counts.
        first, last = bisect_right(ends, start), bisect_left(starts, end) - 1
        stop = next((i for i in range(last, first - 1, -1) if ids[i] in stop_ids), last)
        mask[first : stop + 1] = [1] * (stop + 1 - first)
    return mask


def encode(tokenizer, conversations: list[Conversation]) -> list[Sample]:
    """Tokens and assistant-only loss masks of conversations, rendered with the tokenizer's template."""
    stop_ids = {tokenizer.eos_token_id}
    out = []
    for start in range(0, len(conversations), TOKENIZE_CHUNK):
        chunk = conversations[start : start + TOKENIZE_CHUNK]
        rendered = [assistant_spans(tokenizer, c) for c in chunk]
        # No added special tokens: the template writes BOS itself where the model wants one.
        enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        for conv, (_, spans), ids, offsets in zip(chunk, rendered, enc["input_ids"], enc["offset_mapping"]):
            out.append(Sample(ids, _mask(ids, offsets, spans, stop_ids), conv.source))
    return out


def prompt_ids(tokenizer, conversations: list[list[Message]]) -> list[list[int]]:
    """Tokens of each conversation rendered up to the generation prompt: what the target answers."""
    texts = [render(tokenizer, messages, add_generation_prompt=True) for messages in conversations]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# --- training samples -------------------------------------------------------------------------


def _split_records(cfg: DataConfig, split: str) -> Iterator[tuple[str, dict]]:
    records = iter_all(cfg.train_files)
    if split == "holdout":
        return islice(records, cfg.holdout)
    if split == "train":
        stop = None if cfg.max_samples is None else cfg.holdout + cfg.max_samples
        return islice(records, cfg.holdout, stop)
    raise ValueError(f"split must be 'train' or 'holdout', got {split!r}")


def check_holdout_unseen(held: DataConfig, trained: dict, source: str) -> None:
    """Refuse teacher-forced validation on `held`'s set-aside records (`data.holdout`) where the head
    may have trained on them. `trained`: the data config of its training samples (a store's
    `data.config`, a head's `training.data`), named `source` in the message. The same files: the
    set-aside records must be among those training skipped (holdout at most the trained one). Other
    files that share one: which records were trained on cannot be told, so refused too."""
    if not held.holdout:
        return
    mine = [_file_key(f) for f in held.train_files]
    theirs = [_file_key(f) for f in trained.get("train_files") or []]
    skipped = int(trained.get("holdout") or 0)
    if mine == theirs and held.holdout <= skipped:
        return
    if mine == theirs:
        raise ValueError(
            f"{source}: made with data.holdout={skipped}, so the head trained on records {skipped}.."
            f"{held.holdout - 1} that data.holdout={held.holdout} validates on: set data.holdout≤{skipped}"
        )
    shared = sorted(set(mine) & set(theirs))
    if shared:
        raise ValueError(
            f"{source}: made from data.train_files={trained.get('train_files')}, which share {shared[0]} "
            f"with data.train_files={list(held.train_files)}: data.holdout's records may be trained on; "
            "validate with the training's data.train_files and data.holdout"
        )


def _file_key(path: str | Path) -> str:
    """A data file as one spelling (relative or absolute, `./` or not)."""
    return str(Path(path).expanduser().resolve())


def _fit(sample: Sample, cfg: DataConfig, counts: dict) -> Sample | None:
    """The sample within `max_seq_len` (truncated, or None when dropped), or None if nothing is supervised."""
    if len(sample.input_ids) > cfg.max_seq_len:
        if cfg.overlong == "drop":
            counts["dropped"] += 1
            return None
        counts["truncated"] += 1
        n = cfg.max_seq_len
        sample = Sample(sample.input_ids[:n], sample.loss_mask[:n], sample.source)
    if not any(sample.loss_mask):
        counts["unsupervised"] += 1  # e.g. a long prompt truncated before its answer
        return None
    return sample


def training_sample(tokenizer, conv: Conversation, cfg: DataConfig) -> Sample | None:
    """The sample `load_samples` makes of one conversation of its split (None where it drops it)."""
    counts = dict.fromkeys(("truncated", "dropped", "unsupervised"), 0)
    return _fit(encode(tokenizer, [conv])[0], cfg, counts)


def load_samples(cfg: DataConfig, tokenizer, split: str = "train") -> tuple[list[Sample], dict]:
    """Training (or held-out) samples and counts: records, samples, truncated, dropped, unsupervised,
    tokens, supervised_tokens. `holdout` is the first `cfg.holdout` records of `cfg.train_files`."""
    if cfg.overlong not in ("truncate", "drop"):
        raise ValueError(f"data.overlong must be 'truncate' or 'drop', got {cfg.overlong!r}")
    convs = [to_conversation(r, s, cfg.require_assistant) for s, r in _split_records(cfg, split)]
    counts = dict(records=len(convs), samples=0, truncated=0, dropped=0, unsupervised=0, tokens=0)
    counts["supervised_tokens"] = 0
    samples = [s for s in (_fit(s, cfg, counts) for s in encode(tokenizer, convs)) if s is not None]
    counts["samples"] = len(samples)
    counts["tokens"] = sum(len(s.input_ids) for s in samples)
    counts["supervised_tokens"] = sum(sum(s.loss_mask) for s in samples)
    return samples, counts


# --- prompts for regeneration -----------------------------------------------------------------


def user_turns(conv: Conversation) -> Prompt:
    """The conversation without its assistant turns, grouped so that each group ends on a user turn."""
    turns, pending = [], []
    for message in conv.messages:
        if message["role"] == "assistant":
            continue
        pending.append(message)
        if message["role"] == "user":
            turns.append(pending)
            pending = []
    if not turns:
        raise _error(conv.source, "messages", "no user turn to answer")
    return Prompt(conv.id, conv.source, turns)


def category_of(record: dict, source: str) -> str | None:
    category = record.get("category")
    if category is not None and not isinstance(category, str):
        raise _error(source, "category", f"expected a string, got {category!r:.60}")
    return category


def load_prompts(files: Iterable[str | Path], limit: int | None = None) -> list[Prompt]:
    """The first `limit` records of `files`, cut to their user turns (each to be answered in turn)."""
    prompts = [
        replace(user_turns(to_conversation(r, s)), category=category_of(r, s))
        for s, r in islice(iter_all(files), limit)
    ]
    seen: dict[str, str] = {}
    for p in prompts:
        # Regeneration resumes by id: two records sharing one would make the second look done.
        if p.id in seen:
            raise _error(p.source, "id", f"{p.id!r} is also the id of {seen[p.id]}; ids must be unique")
        seen[p.id] = p.source
    return prompts


def named_prompts(setting: str, files: Iterable[str | Path], limit: int | None = None) -> list[Prompt]:
    """`load_prompts` for the files a setting names (`regenerate.prompts`, `validate.eval_files`),
    refused in one line naming it when they hold none."""
    prompts = load_prompts(files, limit)
    if not prompts:
        raise ConfigError(f"{setting} {list(files)} hold no prompt")
    return prompts
