"""Training throughput, MFU and peak memory of the rmsnorm-restored head (random weights, synthetic store).

    accelerate launch --config_file launch/accelerate/zero2_1gpu.yaml -m benchmarks.bench_train --shape llama3_8b
    python -m benchmarks.bench_train --shape llama3_8b --precision bf16      # one process (train.precision)

MFU counts every model FLOP of a step: the head (fc + one decoder layer, forward, input and weight
gradients, attention included), the draft logits (forward and input gradient: the lm_head is
frozen) and the target logits recomputed from the stored states (forward only). A second part measures the loss' peak memory at two vocabulary
sizes with the same tokens: chunking keeps it flat.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from accelerate import Accelerator

from benchmarks.common import linear_flops_per_token, shape, write_result
from mtp_train.batching import collate
from mtp_train.config import TrainConfig
from mtp_train.heads import HeadSpec, MTPHead
from mtp_train.losses import LossWeights, draft_loss
from mtp_train.train import prepare_training, train_step

PEAK_BF16 = 797e12


def synthetic_samples(cfg, tokens: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(tokens // length):
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=g)
        out.append(
            (
                ids,
                torch.ones(length, dtype=torch.long),
                torch.randn(length, cfg.hidden_size, generator=g).bfloat16(),
            )
        )
    return out


def step_flops(cfg, tokens: int, mean_len: int) -> float:
    h, v = cfg.hidden_size, cfg.vocab_size
    layer = linear_flops_per_token(cfg) / cfg.num_hidden_layers
    attention = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * mean_len / 2  # causal QK^T and PV
    head = 2 * 2 * h * h + layer + attention
    # Head: forward, input and weight gradients (3×). lm_head is frozen: the draft logits need a
    # forward and an input gradient (2×), the target logits a forward (1×).
    return tokens * (3 * head + 2 * (2 * h * v) + 2 * h * v)


def frozen(cfg, device):
    return {
        "model.embed_tokens.weight": torch.randn(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16
        )
        * 0.02,
        "model.norm.weight": torch.ones(cfg.hidden_size, device=device, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        * 0.02,
    }


def throughput(args, acc: Accelerator) -> dict:
    cfg = shape(args.shape)
    head = MTPHead(HeadSpec(args.variant, cfg), frozen(cfg, acc.device))
    tc = TrainConfig(
        steps=args.warmup + args.steps,
        unroll_steps=args.unroll,
        loss_chunk_logits=args.chunk_logits,
        precision=args.precision,
        compile_loss=not args.eager_loss,
    )
    t = prepare_training(acc, head, tc)  # the trainer's own set-up: objective, AdamW, schedule
    dtype = t.param_dtype
    samples = synthetic_samples(cfg, args.tokens, args.sample_len)
    batch = collate(samples, steps=args.unroll).to(acc.device, dtype)
    started = time.perf_counter()
    collate(samples, steps=args.unroll).to(acc.device, dtype)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    load_seconds = time.perf_counter() - started
    torch.cuda.reset_peak_memory_stats()

    batches = itertools.repeat(batch)

    def one_step():
        train_step(t, batches)  # the trainer's own step

    for _ in range(args.warmup):
        one_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        one_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    kernels = {}
    if args.profile:
        try:
            kernels = profile(one_step)
        except Exception as e:  # the figures above stand without it
            kernels = {"profile_error": repr(e)}
    tokens = batch.tokens - len(batch.segments.cu_seqlens) + 1
    flops = args.unroll * step_flops(cfg, tokens, args.sample_len)  # every chained step: the same work
    return {
        "micro_batch_tokens": tokens,
        "unroll_steps": args.unroll,
        "param_dtype": str(dtype),
        "autocast": str(t.autocast),
        "batch_load_seconds": load_seconds,
        "tokens_per_s": tokens / seconds,
        "step_seconds": seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / PEAK_BF16,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "head_parameters": sum(p.numel() for p in acc.unwrap_model(t.objective).head.parameters()),
        **kernels,
    }


def profile(one_step, steps: int = 3, top: int = 25) -> dict:
    """Where a step's GPU time goes: the `top` kernels by total CUDA time over `steps` steps, as
    shares of the profiled steps' GPU time, and the share of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = [
        e
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.device_type.name == "CUDA" and "#" not in e.key  # not annotations
    ]
    busy = sum(e.device_time_total for e in events) / 1e6
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        "profile_gpu_busy_share": busy / wall,
        "profile_kernels": [
            {"name": e.key[:120], "share": e.device_time_total / 1e6 / busy, "calls": e.count // steps}
            for e in events[:top]
        ],
    }


def loss_memory(hidden: int, vocab: int, tokens: int, chunk: int, compiled: bool) -> float:
    """Peak GiB above the inputs for forward + backward of the chunked loss (as the trainer runs it)."""
    z = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    lm_head = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    draft_loss(z, target, lm_head, LossWeights(), chunk, compiled).loss.backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sample-len", type=int, default=1024)
    p.add_argument("--chunk-logits", type=int, default=2**27)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--unroll", type=int, default=1, help="chained training steps (train.unroll_steps)")
    p.add_argument("--variant", default="rmsnorm-restored")
    p.add_argument("--precision", default="auto", help="train.precision (one process: bf16 on a GPU)")
    p.add_argument("--eager-loss", action="store_true", help="train.compile_loss=false: the baseline")
    p.add_argument("--skip-loss-memory", action="store_true")
    p.add_argument("--profile", action="store_true", help="also record the top kernels by GPU time")
    args = p.parse_args()
    acc = Accelerator()
    figures = {
        "command": (
            "accelerate launch --config_file launch/accelerate/zero2_1gpu.yaml -m benchmarks.bench_train"
            if acc.state.deepspeed_plugin
            else "python -m benchmarks.bench_train"
        )
        + f" --shape {args.shape} --tokens {args.tokens} --unroll {args.unroll} --variant {args.variant}"
        + ("" if acc.state.deepspeed_plugin else f" --precision {args.precision}")
        + (" --eager-loss" if args.eager_loss else ""),
        "distributed": str(acc.distributed_type),
        **throughput(args, acc),
    }
    h = shape(args.shape).hidden_size
    for vocab in () if args.skip_loss_memory else (49152, 128256):
        rows = max(1, args.chunk_logits // vocab)
        figures[f"loss_peak_gib_vocab_{vocab}"] = loss_memory(
            h, vocab, args.tokens, rows, not args.eager_loss
        )
    if not args.skip_loss_memory:
        figures["loss_peak_gib_vocab_128k_unchunked_estimate"] = args.tokens * 128256 * 4 * 3 / 2**30
    if acc.is_main_process:
        suffix = "" if args.unroll == 1 else f"_unroll{args.unroll}"
        variant = "" if args.variant == "rmsnorm-restored" else f"_{args.variant}"
        plain = "" if acc.state.deepspeed_plugin else f"_one_process_{args.precision}"
        eager = "_eager_loss" if args.eager_loss else ""
        write_result(f"train_{args.shape}{variant}{suffix}{plain}{eager}", figures)


if __name__ == "__main__":
    main()
