"""Batched greedy decoding: inference_ref's `generate` (static KV cache, CUDA-graph step; its layers
eager, then compiled) vs transformers' `generate`, same weights, same prompts, same number of new
tokens, one run. Each is warmed up at the measured batch first. Ours also reports where one call's
time goes: the prefill, building the graphed step (warm-ups and capture), one replayed step, and
the kernels one step launches when it is not graphed; and the call's decode steps alone (its
prefill and graph build taken out) against HF's (its call less a one-token call), whose difference
from the replayed step is the host's work per step (#36: ≤ 0.5 ms, decode ≥ 10× HF).

    python -m benchmarks.bench_decode --shape smollm2_135m --batch 64 512 --new 160
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import LlamaForCausalLM

from benchmarks.common import DEVICE, DTYPE, hf_copy, shape, sync, timed, write_result
from inference_ref.decode_graph import DecodeStep
from inference_ref.generate import generate, last_logits, prefill
from inference_ref.models.llama import random_llama

VARIANTS = ("graph", "graph_compiled")


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


def kernels_per_step(model, cache) -> int:
    """GPU kernels one decode step launches when it is not graphed: what the graph replays, but for
    the un-graphed step's mask, which ends at the longest row instead of the cache's end."""
    from torch.profiler import ProfilerActivity, profile

    step = DecodeStep(model, cache, graph=False)
    ids = torch.zeros(cache.lengths.shape[0], 1, dtype=torch.long, device=cache.lengths.device)
    step(ids)
    on_gpu = ids.is_cuda
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        step(ids)
        sync()
    if not on_gpu:  # a smoke run on CPU: aten ops stand in for kernels
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


@torch.inference_mode()
def phases(model, prompts: list[list[int]], new: int, replays: int = 50) -> dict:
    """Where one `generate` call's time goes, phase by phase."""
    sync()
    t0 = time.perf_counter()
    cache, hidden = prefill(model, prompts, max(map(len, prompts)) + new)
    last_logits(model, hidden, cache.lengths).argmax(-1)
    sync()
    t1 = time.perf_counter()
    step = DecodeStep(model, cache)
    sync()
    t2 = time.perf_counter()
    ids = torch.zeros(len(prompts), 1, dtype=torch.long, device=cache.lengths.device)
    for _ in range(replays):  # the cache lengths do not move: every replay is the same step
        step(ids).argmax(-1)
    sync()
    t3 = time.perf_counter()
    return {
        "prefill_ms": (t1 - t0) * 1e3,
        "build_graphed_step_ms": (t2 - t1) * 1e3,
        "graphed_step_ms": (t3 - t2) * 1e3 / replays,
        "kernels_per_step": kernels_per_step(model, cache),
    }


def measure(model, prompts: list[list[int]], new: int) -> dict:
    batch = len(prompts)
    warm = timed(lambda: generate(model, prompts, 8, eos_ids=[]))  # compiles, if compiled
    # A call at the measured length first: a cache of another length can recompile the compiled
    # layers (a dynamic-shape variant), which must not be counted as the measured call's steps.
    warm_full = timed(lambda: generate(model, prompts, new, eos_ids=[]))
    seconds = timed(lambda: generate(model, prompts, new, eos_ids=[]))
    split = phases(model, prompts, new)
    # The call's decode steps alone (its prefill and graph build, measured apart, taken out): what
    # a step costs with the host's work between replays, against the replayed step alone.
    decode_step = (seconds * 1e3 - split["prefill_ms"] - split["build_graphed_step_ms"]) / (new - 1)
    return {
        "warm_up_s": warm,
        "warm_up_full_length_s": warm_full,
        "new_tokens_per_s": batch * new / seconds,
        "step_ms_incl_host": seconds * 1e3 / new,
        "decode_step_ms": decode_step,
        "host_ms_per_step": decode_step - split["graphed_step_ms"],
        **split,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2_135m")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 512])
    p.add_argument("--new", type=int, default=160)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--no-hf", action="store_true", help="ours only (when HF would take too long)")
    args = p.parse_args()
    cfg = shape(args.shape)
    model = random_llama(cfg, device=DEVICE, dtype=DTYPE)
    hf = None if args.no_hf else hf_copy(model, LlamaForCausalLM)
    rows = []
    for batch in args.batch:
        prompts = prompts_for(batch, cfg.vocab_size)
        row: dict = {"batch": batch, "new_tokens": batch * args.new}
        for variant in args.variants:
            model.compiled_layers = False
            if variant == "graph_compiled":
                model.compile_layers()
            row[variant] = measure(model, prompts, args.new)
            row[variant]["compiled"] = model.runs_compiled("cached")  # false also after a fallback
            print(batch, variant, row[variant], flush=True)
        if hf is not None:
            run_hf(hf, prompts, 8)
            theirs = run_hf(hf, prompts, args.new)
            first = run_hf(hf, prompts, 1)  # its prefill and first token: the rest is decode steps
            row["hf_generate_new_tokens_per_s"] = batch * args.new / theirs
            row["hf_decode_step_ms"] = (theirs - first) * 1e3 / (args.new - 1)
            for variant in args.variants:
                ours = row[variant]
                ours["speedup"] = ours["new_tokens_per_s"] / row["hf_generate_new_tokens_per_s"]
                ours["decode_speedup"] = row["hf_decode_step_ms"] / ours["decode_step_ms"]
        print(row, flush=True)
        rows.append(row)
    write_result(
        # a run at other batches than the default's keeps its own file beside the default run's
        f"decode_{args.shape}"
        + ("" if args.batch == p.get_default("batch") else "_b" + "_".join(map(str, args.batch))),
        {"command": "python -m benchmarks.bench_decode " + " ".join(sys.argv[1:]), "rows": rows},
    )


if __name__ == "__main__":
    main()
