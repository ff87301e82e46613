"""The long-input set: 80 set-aside prompts that carry a document, made from the shared chat
prompts' own text (issue #40 item 2), scored beside MT-bench and used, never MT-bench, to choose.

    python -m experiments.long_inputs ../shared/data/train/chat_prompts.jsonl data/long_inputs.jsonl
    python -m experiments.long_inputs mix RUN_DIR/prompts/chat_train.jsonl RUN_DIR/prompts/long_mix.jsonl [PER_TASK]

Four tasks, 20 prompts each (MT-bench's format: `question_id`, `category`, `turns`, plus the
`source_ids` of the shared records whose text it uses and their licenses):
    summarize  one Open-Assistant conversation's human-written assistant turns, joined, to summarize;
    qa         four Open-Assistant answers as numbered passages and the question one of them answers;
    translate  one Open-Assistant answer to translate into French;
    code       an arena-hard coding request that carries code, whose code is to be explained.
Each shared record is used once. Training runs drop the records named in `source_ids` and every
record opening with the same question (`held_out`, `experiments.quality_smollm2 split-prompts`), so
no head trains on a prompt of this set or on a target answer to one of its questions.

`mix` makes training prompts of the same four tasks (#40 item 3's long-input data mix) from the
records a run trains on (its `prompts/chat_train.jsonl`, which already leaves out the set-aside
prompts and this set's records), ids `mix-…`. The set used most of the shared Open-Assistant
answers (371 records carry one), so the mix also takes its documents from the records' own long
first user turns (1,130 of 27k are ≥ 1,000 characters): those to summarize and to translate, the
Open-Assistant answers left for QA, the coding requests left to explain; up to PER_TASK per task
(default 500), documents of at most MIX_MAX_CHARS so that a prompt stays within regeneration's
1,024 prompt tokens. Each record once.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

PER_TASK, SEED = 20, 0
MAX_CHARS = 6000  # ≈ 1,500 SmolLM2 tokens: the prompt and 256 new tokens stay well inside 8k
MIX_PER_TASK, MIX_SEED = 500, 1
MIX_MAX_CHARS = 3600  # ≈ 900 tokens: inside regenerate.max_prompt_tokens (1,024) with the instruction
SUMMARIZE = "Summarize the following text in one paragraph.\n\n"
TRANSLATE = "Translate the following text into French.\n\n"


def read(path: Path) -> list[dict]:
    # split on "\n" only: splitlines() would also cut at U+2028 inside a JSON string
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def answers(record: dict) -> list[str]:
    return [m["content"].strip() for m in record["messages"] if m["role"] == "assistant"]


def code_lines(text: str) -> int:
    """Lines that look like code: the test for a coding request that carries some."""
    pattern = (
        r"[;{}]\s*$|^\s*(def|class|import|return|for|if|#include|function|const|let|var|public|private)\b"
    )
    return sum(1 for line in text.split("\n") if re.search(pattern, line))


def build(
    records: list[dict],
    per_task: int = PER_TASK,
    seed: int = SEED,
    max_chars: int = MAX_CHARS,
    prefix: str = "long",
    strict: bool = True,
) -> list[dict]:
    """The four tasks' prompts, `per_task` each (strict: exactly, or exit; else as many as fit)."""
    rng = random.Random(seed)
    conversations = [r for r in records if r["source"].startswith("Open-Assistant") and answers(r)]
    rng.shuffle(conversations)
    coding = [
        r
        for r in records
        if r["source"].startswith("arena-hard")
        and r["category"] == "coding"
        and 600 <= len(r["messages"][-1]["content"]) <= max_chars
        and code_lines(r["messages"][-1]["content"]) >= 8
    ]
    rng.shuffle(coding)

    def take(test, n: int) -> list[dict]:
        chosen = [r for r in conversations if test(r)][:n]
        for r in chosen:
            conversations.remove(r)  # each shared record once
        if len(chosen) < n and strict:
            raise SystemExit(f"long_inputs: only {len(chosen)} shared conversations fit, {n} needed")
        return chosen

    out = []
    for r in take(lambda r: 1500 <= len("\n\n".join(answers(r))) <= max_chars, per_task):
        text = "\n\n".join(answers(r))
        out.append(item("summarize", SUMMARIZE + text, [r]))
    for r in take(lambda r: 1000 <= len(answers(r)[0]) <= min(3000, max_chars), per_task):
        text = answers(r)[0]
        out.append(item("translate", TRANSLATE + text, [r]))
    for _ in range(per_task):
        group = take(lambda r: 400 <= len(answers(r)[0]) <= min(1400, max_chars // 4), 4)
        if len(group) < 4:  # not strict: no four passages left
            break
        asked = rng.randrange(4)
        passages = "\n\n".join(f"Passage {i + 1}:\n{answers(r)[0]}" for i, r in enumerate(group))
        question = next(m["content"] for m in group[asked]["messages"] if m["role"] == "user")
        prompt = f"Answer the question using only the passages below.\n\n{passages}\n\nQuestion: {question}"
        out.append(item("qa", prompt, group))
    if len(coding) < per_task and strict:
        raise SystemExit(f"long_inputs: only {len(coding)} coding requests carry code, {per_task} needed")
    for r in coding[:per_task]:
        prompt = (
            f"Explain, step by step, what the code in this request does.\n\n{r['messages'][-1]['content']}"
        )
        out.append(item("code", prompt, [r]))
    return [{"question_id": f"{prefix}-{i:03d}", **x} for i, x in enumerate(out)]


def training_mix(records: list[dict], per_task: int = MIX_PER_TASK) -> list[dict]:
    """Long-input training prompts from `records` (a run's training records): the set's QA and code
    prompts from what is left of theirs, then documents to summarize and translate from the long
    first user turns of the records not used; as many as fit, up to `per_task` each."""
    rng = random.Random(MIX_SEED)
    qa_code = build(records, per_task, MIX_SEED, MIX_MAX_CHARS, prefix="mix", strict=False)
    qa_code = [x for x in qa_code if x["category"] in ("qa", "code")]
    used = {i for x in qa_code for i in x["source_ids"]}
    documents = [
        (r, text)
        for r in records
        if r["id"] not in used and (text := (first_question(r) or "")) and 1000 <= len(text) <= MIX_MAX_CHARS
    ]
    rng.shuffle(documents)
    longest = sorted(documents, key=lambda d: -len(d[1]))  # the longest ones to summarize
    summarize = [d for d in longest if len(d[1]) >= 1500][:per_task]
    chosen = {id(r) for r, _ in summarize}
    translate = [d for d in documents if id(d[0]) not in chosen][:per_task]
    out = [item("summarize", SUMMARIZE + t, [r]) for r, t in summarize]
    out += [item("translate", TRANSLATE + t, [r]) for r, t in translate]
    out += [{k: v for k, v in x.items() if k != "question_id"} for x in qa_code]
    return [{"question_id": f"mix-{i:04d}", **x} for i, x in enumerate(out)]


def item(task: str, prompt: str, sources: list[dict]) -> dict:
    return {
        "category": task,
        "turns": [prompt],
        "source_ids": [r["id"] for r in sources],
        "license": sorted({r["license"] for r in sources}),
    }


def source_ids(path: Path) -> set[str]:
    """The shared records a long-input set uses."""
    return {i for r in read(path) for i in r["source_ids"]}


def first_question(record: dict) -> str | None:
    users = [m["content"].strip() for m in record.get("messages", []) if m.get("role") == "user"]
    return users[0] if users else None


def held_out(records: list[dict], path: Path) -> list[bool]:
    """Which of `records` training must leave out for the set at `path` to stay unseen: the records it
    uses and every record that opens with the same question (Open-Assistant's conversation trees
    share their first question across branches, each branch a record of its own)."""
    ids = source_ids(path)
    questions = {first_question(r) for r in records if r.get("id") in ids} - {None}
    return [r.get("id") in ids or first_question(r) in questions for r in records]


def main(argv: list[str]) -> None:
    if argv[0] == "mix":
        chat, out = Path(argv[1]), Path(argv[2])
        items = training_mix(read(chat), *(int(a) for a in argv[3:4]))
    else:
        chat, out = Path(argv[0]), Path(argv[1])
        items = build(read(chat))
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items), encoding="utf-8")
    tasks = {t: sum(x["category"] == t for x in items) for t in ("summarize", "translate", "qa", "code")}
    print(f"long_inputs: {len(items)} prompts {tasks} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
