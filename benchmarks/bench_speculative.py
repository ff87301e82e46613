"""Speculative decoding against target-only decoding in wall-clock, greedy, at small batches:
a real target, a trained head, MT-bench first turns. Target-only is `generate` (its decode step a
CUDA graph); speculative is `speculative_generate`, eager (with and without cuDNN's attention)
and with each step a CUDA graph; `--compile` compiles the target's layers for both loops.
Greedy outputs are compared with target-only ones (`*_same_tokens_as_target`): in fp32 they are
identical; in bf16 a verify step and a decode step round differently, and outputs part on near-ties.

    python -m benchmarks.bench_speculative --target DIR --head DIR [--batch 1 8] [--k 1 2 3 4]
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoTokenizer

from benchmarks.common import DEVICE, DTYPE, timed, write_result
from inference_ref.draft import load_draft
from inference_ref.generate import generate
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.target import eos_ids, load_target
from mtp_train.data import load_prompts, prompt_ids


def timed_call(fn, *args):
    """(fn(*args), its wall-clock seconds), timed as every benchmark here times."""
    box = []
    seconds = timed(lambda: box.append(fn(*args)))
    return box[0], seconds


def target_only_all(target, groups, new: int, eos) -> list[list[int]]:
    return [t for g in groups for t in generate(target, g, new, eos)]


VARIANTS = ("eager", "eager_no_cudnn", "graph")
"""eager; eager with cuDNN's SDPA backend off (it plans per attention shape on the host; measured
on the H200, that was not what made the eager loop slow); each step one CUDA graph replay."""


def speculative_all(target, draft, groups, new: int, eos, k: int, variant: str) -> list:
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn and variant != "eager_no_cudnn")
    try:
        graph = variant == "graph"
        return [speculative_generate(target, draft, g, new, eos, Chain(k), graph=graph) for g in groups]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--prompts", default="data/mt_bench.jsonl")
    p.add_argument("--num", type=int, default=16, help="prompts (first turns)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--compile", action="store_true", help="the target's layers compiled, in both loops")
    args = p.parse_args()
    target = load_target(args.target, DEVICE, DTYPE, compile=args.compile)
    draft = load_draft(args.head, target)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    eos = eos_ids(target, tokenizer)
    prompts = prompt_ids(tokenizer, [q.turns[0] for q in load_prompts([args.prompts], limit=args.num)])
    command = "python -m benchmarks.bench_speculative " + " ".join(sys.argv[1:])
    rows = []
    for batch in args.batch:
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        # warm-up at full length on two groups: a compiled target compiles its shape variants here
        target_only_all(target, groups[:2], args.new, eos)
        base, base_s = timed_call(target_only_all, target, groups, args.new, eos)
        new_tokens = sum(map(len, base))
        row = {"batch": batch, "new_tokens": new_tokens, "target_only_tokens_per_s": new_tokens / base_s}
        rows.append(row)
        print(f"batch {batch}: target-only {row['target_only_tokens_per_s']:,.0f} tok/s", flush=True)
        for k in args.k:
            for variant in args.variants:
                speculative_all(target, draft, groups[:1], 16, eos, k, variant)  # warm-up
                row.update(speculative_row(target, draft, groups, base, args.new, eos, k, variant, row))
                # written after every measurement: a run cut short keeps what it measured
                write_result(
                    "speculative_wallclock",
                    {
                        "command": command,
                        "prompts": len(prompts),
                        "dtype": str(DTYPE),
                        "target_compiled": target.runs_compiled("cached"),
                        "rows": rows,
                    },
                )


def speculative_row(target, draft, groups, base, new: int, eos, k: int, variant: str, row: dict) -> dict:
    """One (k, variant) measurement against the row's target-only figure."""
    outs, seconds = timed_call(speculative_all, target, draft, groups, new, eos, k, variant)
    tokens = [t for o in outs for t in o.tokens]
    name = f"k{k}_{variant}"
    tokens_per_s = sum(map(len, tokens)) / seconds
    figures = {
        f"{name}_tokens_per_s": tokens_per_s,
        f"{name}_speedup": tokens_per_s / row["target_only_tokens_per_s"],
        f"{name}_tau": sum(o.stats.emitted for o in outs) / sum(o.stats.steps for o in outs),
        f"{name}_same_tokens_as_target": tokens == base,
        f"{name}_seconds": seconds,
        # the host's work between steps, which a graphed step's device waits for (#36: ≤ 0.5 ms)
        f"{name}_host_ms_per_step": 1e3
        * sum(o.stats.host_s for o in outs)
        / max(sum(o.stats.iterations - 1 for o in outs), 1),
    }
    if variant != "graph":  # the eager loop times its phases (synchronizing around each)
        figures[f"{name}_draft_s"] = sum(o.stats.draft_s for o in outs)
        figures[f"{name}_target_s"] = sum(o.stats.target_s for o in outs)
    print(
        f"batch {row['batch']} {name}: {tokens_per_s:,.0f} tok/s, {figures[f'{name}_speedup']:.2f}x",
        flush=True,
    )
    return figures


if __name__ == "__main__":
    main()
