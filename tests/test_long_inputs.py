"""The long-input set's builder and its training mix (experiments/long_inputs.py; #40 items 2-3):
every record used once, the documents within their bounds, the set's records never in the mix."""

from __future__ import annotations

import pytest

from experiments import long_inputs as li


def record(i: int, source: str, user: str, answer: str | None = None, category: str = "chat") -> dict:
    messages = [{"role": "user", "content": user}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {
        "id": f"r{i}",
        "source": source,
        "category": category,
        "license": "cc-by-4.0",
        "messages": messages,
    }


def shared_records() -> list[dict]:
    """Open-Assistant conversations with answers of every length the tasks take, coding requests
    that carry code, and prompts whose first user turn is itself a document."""
    out, i = [], 0
    for n in [2000] * 30 + [1500] * 30 + [600] * 100:  # summarize, translate, qa passages
        out.append(record(i, "Open-Assistant/oasst2", f"question {i}?", "word " * (n // 5)))
        i += 1
    code = "\n".join(f"int x{j} = {j};" for j in range(120))
    for _ in range(30):
        out.append(record(i, "arena-hard/v2", f"Fix this:\n{code}", category="coding"))
        i += 1
    for n in [3000] * 20 + [1200] * 20 + [200] * 20:  # documents in the prompt (the last too short)
        out.append(record(i, "GPTeacher", f"doc {i} " + "text " * (n // 5)))
        i += 1
    return out


def test_the_set_takes_its_twenty_per_task_each_record_once():
    items = li.build(shared_records())
    assert [sum(x["category"] == t for x in items) for t in ("summarize", "translate", "qa", "code")] == [
        20
    ] * 4
    ids = [i for x in items for i in x["source_ids"]]
    assert len(ids) == len(set(ids))
    assert all(len(x["turns"]) == 1 and x["question_id"].startswith("long-") for x in items)


def test_too_few_records_for_the_set_is_an_error():
    with pytest.raises(SystemExit, match="shared conversations fit"):
        li.build(shared_records()[:50])


def test_the_training_mix_uses_what_the_set_left_and_long_prompts():
    records = shared_records()
    eval_ids = {i for x in li.build(records) for i in x["source_ids"]}
    training = [r for r in records if r["id"] not in eval_ids]
    mix = li.training_mix(training, per_task=10)
    tasks = {t: [x for x in mix if x["category"] == t] for t in ("summarize", "translate", "qa", "code")}
    assert [len(tasks[t]) for t in tasks] == [10, 10, 5, 10]  # 20 short answers left: five QA prompts
    ids = [i for x in mix for i in x["source_ids"]]
    assert len(ids) == len(set(ids)) and not set(ids) & eval_ids
    for x in tasks["summarize"] + tasks["translate"]:  # a document of 1,000 … MIX_MAX_CHARS characters
        document = x["turns"][0].split("\n\n", 1)[1]
        assert 1000 <= len(document) <= li.MIX_MAX_CHARS
    assert all(len(x["turns"][0].split("\n\n", 1)[1]) >= 1500 for x in tasks["summarize"])
    assert len({x["question_id"] for x in mix}) == len(mix) and all(
        x["question_id"].startswith("mix-") for x in mix
    )
