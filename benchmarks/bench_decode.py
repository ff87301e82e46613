"""Batched greedy decoding: inference_ref's `generate` (static KV cache, CUDA-graph step) vs
transformers' `generate`, same weights, same prompts, same number of new tokens, one run.

    python -m benchmarks.bench_decode --shape smollm2_135m --batch 64 512 --new 160
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaForCausalLM

from benchmarks.common import DEVICE, DTYPE, hf_copy, shape, timed, write_result
from inference_ref.generate import generate
from inference_ref.loading import random_llama


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_hf(hf, prompts: list[list[int]], new: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)

    def go():
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        return timed(go)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2_135m")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 512])
    p.add_argument("--new", type=int, default=160)
    p.add_argument("--no-hf", action="store_true", help="ours only (when HF would take too long)")
    args = p.parse_args()
    cfg = shape(args.shape)
    model = random_llama(cfg, device=DEVICE, dtype=DTYPE)
    hf = None if args.no_hf else hf_copy(model, LlamaForCausalLM)
    rows = []
    for batch in args.batch:
        prompts = prompts_for(batch, cfg.vocab_size)
        generate(model, prompts[:4], 8, eos_ids=[])  # warm-up
        ours = timed(lambda: generate(model, prompts, args.new, eos_ids=[]))  # noqa: B023
        row = {
            "batch": batch,
            "new_tokens": batch * args.new,
            "inference_ref_new_tokens_per_s": batch * args.new / ours,
        }
        if hf is not None:
            run_hf(hf, prompts[:4], 8)
            theirs = run_hf(hf, prompts, args.new)
            row["hf_generate_new_tokens_per_s"] = batch * args.new / theirs
            row["speedup"] = theirs / ours
        print(row, flush=True)
        rows.append(row)
    write_result(
        f"decode_{args.shape}",
        {
            "command": f"python -m benchmarks.bench_decode --shape {args.shape} --batch {' '.join(map(str, args.batch))} --new {args.new}",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
