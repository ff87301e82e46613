"""The published eagle1 and dflash heads' τ in bf16 against fp32, our loop on a CPU, the same
prompts (the first turns of the first N MT-bench questions), greedy, k = 4 (the README's table):
    python docs/results/levers1500c_run/precision_check.py heads/smollm2_135m/eagle1,heads/smollm2_135m/dflash 20 float32 128
    python docs/results/levers1500c_run/precision_check.py heads/smollm2_135m/eagle1,heads/smollm2_135m/dflash 20 bfloat16 128
Prints each head's drafts tried and accepted per position, and τ."""

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from inference_ref.draft import load_draft
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.target import load_target
from mtp_train.data import load_prompts, prompt_ids
from mtp_train.target_files import resolve_target

heads, prompts, dtype, new = (
    sys.argv[1].split(","),
    int(sys.argv[2]),
    getattr(torch, sys.argv[3]),
    int(sys.argv[4]),
)
target_dir = resolve_target("smollm2-135m-instruct")
tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
ids = prompt_ids(tokenizer, [p.turns[0] for p in load_prompts([Path("data/mt_bench.jsonl")], limit=prompts)])
target = load_target(target_dir, "cpu", dtype)
eos = sorted({tokenizer.eos_token_id, *target.cfg.eos_token_ids} - {None})
for head in heads:
    stats = speculative_generate(target, load_draft(head, target), ids, new, eos, Chain(4)).stats
    print(
        head,
        sys.argv[3],
        "tried",
        stats.tried,
        "accepted",
        stats.accepted,
        f"τ {stats.mean_accepted_len:.2f}",
    )
