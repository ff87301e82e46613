"""The long-input set: 80 set-aside prompts that carry a document, made from the shared chat
prompts' own text (issue #40 item 2), scored beside MT-bench and used, never MT-bench, to choose.

    python -m experiments.long_inputs ../shared/data/train/chat_prompts.jsonl data/long_inputs.jsonl

Four tasks, 20 prompts each (MT-bench's format: `question_id`, `category`, `turns`, plus the
`source_ids` of the shared records whose text it uses and their licenses):
    summarize  one Open-Assistant conversation's human-written assistant turns, joined, to summarize;
    qa         four Open-Assistant answers as numbered passages and the question one of them answers;
    translate  one Open-Assistant answer to translate into French;
    code       an arena-hard coding request that carries code, whose code is to be explained.
Each shared record is used once. Training runs drop the records named in `source_ids` and every
record opening with the same question (`held_out`, `experiments.quality_smollm2 split-prompts`), so
no head trains on a prompt of this set or on a target answer to one of its questions.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

PER_TASK, SEED = 20, 0
MAX_CHARS = 6000  # ≈ 1,500 SmolLM2 tokens: the prompt and 256 new tokens stay well inside 8k


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


def build(records: list[dict]) -> list[dict]:
    rng = random.Random(SEED)
    conversations = [r for r in records if r["source"].startswith("Open-Assistant") and answers(r)]
    rng.shuffle(conversations)
    coding = [
        r
        for r in records
        if r["source"].startswith("arena-hard")
        and r["category"] == "coding"
        and 600 <= len(r["messages"][-1]["content"]) <= MAX_CHARS
        and code_lines(r["messages"][-1]["content"]) >= 8
    ]
    rng.shuffle(coding)

    def take(test, n: int) -> list[dict]:
        chosen = [r for r in conversations if test(r)][:n]
        for r in chosen:
            conversations.remove(r)  # each shared record once
        if len(chosen) < n:
            raise SystemExit(f"long_inputs: only {len(chosen)} shared conversations fit, {n} needed")
        return chosen

    out = []
    for r in take(lambda r: 1500 <= len("\n\n".join(answers(r))) <= MAX_CHARS, PER_TASK):
        text = "\n\n".join(answers(r))
        out.append(item("summarize", f"Summarize the following text in one paragraph.\n\n{text}", [r]))
    for r in take(lambda r: 1000 <= len(answers(r)[0]) <= 3000, PER_TASK):
        text = answers(r)[0]
        out.append(item("translate", f"Translate the following text into French.\n\n{text}", [r]))
    for _ in range(PER_TASK):
        group = take(lambda r: 400 <= len(answers(r)[0]) <= 1400, 4)
        asked = rng.randrange(4)
        passages = "\n\n".join(f"Passage {i + 1}:\n{answers(r)[0]}" for i, r in enumerate(group))
        question = next(m["content"] for m in group[asked]["messages"] if m["role"] == "user")
        prompt = f"Answer the question using only the passages below.\n\n{passages}\n\nQuestion: {question}"
        out.append(item("qa", prompt, group))
    if len(coding) < PER_TASK:
        raise SystemExit(f"long_inputs: only {len(coding)} coding requests carry code, {PER_TASK} needed")
    for r in coding[:PER_TASK]:
        prompt = (
            f"Explain, step by step, what the code in this request does.\n\n{r['messages'][-1]['content']}"
        )
        out.append(item("code", prompt, [r]))
    return [{"question_id": f"long-{i:03d}", **x} for i, x in enumerate(out)]


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
    chat, out = Path(argv[0]), Path(argv[1])
    items = build(read(chat))
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items), encoding="utf-8")
    print(f"long_inputs: {len(items)} prompts -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
