"""Online training (`train.states=online`) against training from a store, one GPU, one run, the
same head and micro-batches: the trainer's own step (`train.train_step`) fed by the online states'
own forward (`mtp_train.states.OnlineStates.samples`: the target's packed forward, compiled) in
the training thread, or the same forward one micro-batch ahead on a background thread (what
`train.micro_batches` does with the target whole), or by states precomputed once into pinned host
memory (the store path at its best: no disk read). Also the precompute forward alone, and from
these the GPU-hours for one billion tokens either way.

    python -m benchmarks.bench_online --shape llama3_8b --variant rmsnorm-restored
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
from accelerate import Accelerator

from benchmarks.common import lognormal_lengths, shape, write_result
from inference_ref.head_spec import HeadSpec, default_aux_layers
from inference_ref.models import TARGET_KINDS
from mtp_train.batching import collate, prefetched
from mtp_train.config import TrainConfig
from mtp_train.data import Sample
from mtp_train.heads import build
from mtp_train.states import OnlineStates
from mtp_train.store import bytes_per_token
from mtp_train.train import prepare_training, train_step


def frozen_of(target) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": target.embed_tokens.weight.detach(),
        "model.norm.weight": target.norm.weight.detach(),
        "lm_head.weight": target.lm_head.weight.detach(),
    }


def micro_batches(cfg, tokens_per_batch: int, batches: int) -> list[list[Sample]]:
    """Random token sequences of lognormal lengths (median 600), packed up to the budget."""
    g = torch.Generator().manual_seed(0)
    lengths = lognormal_lengths(tokens_per_batch * batches, cap=tokens_per_batch)
    out, current, used = [], [], 0
    for n in lengths:
        if current and used + n > tokens_per_batch:
            out.append(current)
            current, used = [], 0
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        current.append(Sample(ids, [1] * n, "bench"))
        used += n
    return out[:batches]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(t, batches, steps: int) -> float:
    for _ in range(2):  # warm-up: allocator, compiled kernels
        train_step(t, batches)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        train_step(t, batches)
    sync()
    return (time.perf_counter() - started) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--variant", default="rmsnorm-restored")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--unroll", type=int, default=1)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.shape == "tiny":  # a CPU smoke run of the script itself
        cfg = TARGET_KINDS["llama"].config(
            **{**TARGET_KINDS["llama"].tiny, "num_hidden_layers": 6, "vocab_size": 512}
        )
    else:
        cfg = shape(args.shape)
    device = torch.device("cuda" if cuda else "cpu")
    target = TARGET_KINDS[cfg.model_type].random(
        cfg, device=device, dtype=torch.bfloat16 if cuda else torch.float32
    )
    if cuda and not args.no_compile:
        target.compile_layers()
    aux = default_aux_layers(cfg.num_hidden_layers) if args.variant.startswith("eagle3") else ()
    spec = HeadSpec(args.variant, cfg, aux_layers=aux)
    head = build(spec, frozen_of(target))
    tc = TrainConfig(steps=10**6, unroll_steps=args.unroll, tokens_per_micro_batch=args.tokens)
    t = prepare_training(Accelerator(), head, tc)
    data = micro_batches(cfg, args.tokens, args.steps + 2)
    flat = [s for batch in data for s in batch]
    online = OnlineStates(flat, target, aux, "bf16", "bench")
    spans, first = [], 0
    for batch in data:
        spans.append(list(range(first, first + len(batch))))
        first += len(batch)

    online.samples(spans[0])  # warm-up (the compile), not counted
    online.forward_s, online.tokens = 0.0, 0
    # The store path: every micro-batch's states computed once, kept in pinned host memory.
    host = [[tuple(x.cpu() for x in item) for item in online.samples(ids)] for ids in spans]
    stored = [collate(items, args.unroll) for items in host]
    stored = [b.pin_memory() for b in stored] if cuda else stored
    forward_tps = online.tokens / online.forward_s
    store_s = timed_steps(t, itertools.cycle(stored), args.steps)

    def load(ids):
        return collate(online.samples(ids), args.unroll)

    online_s = timed_steps(t, map(load, itertools.cycle(spans)), args.steps)  # in the training thread
    ahead = prefetched(load, itertools.cycle(spans), depth=1, workers=1)  # train.micro_batches' way
    prefetched_s = timed_steps(t, ahead, args.steps)
    ahead.close()
    tokens = sum(b.tokens for b in stored) / len(stored)
    store_tps, online_tps, prefetched_tps = tokens / store_s, tokens / online_s, tokens / prefetched_s
    billion = 1e9
    store_hours = billion / forward_tps / 3600 + billion / store_tps / 3600
    figures = {
        "command": "python -m benchmarks.bench_online " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "variant": args.variant,
        "aux_layers": list(aux),
        "micro_batch_tokens": tokens,
        "unroll_steps": args.unroll,
        "compiled_target": cuda and not args.no_compile,
        "precompute_forward_tokens_per_s": forward_tps,
        "train_from_store_tokens_per_s": store_tps,
        "train_online_tokens_per_s": online_tps,
        "train_online_prefetched_tokens_per_s": prefetched_tps,
        "online_vs_store_training": online_tps / store_tps,
        "online_prefetched_vs_online": prefetched_tps / online_tps,
        "online_prefetched_vs_store_training": prefetched_tps / store_tps,
        "gpu_hours_per_1b_tokens": {
            "store (precompute forward + training)": store_hours,
            "online": billion / online_tps / 3600,
            "online, next forward prefetched": billion / prefetched_tps / 3600,
        },
        "store_tb_per_1b_tokens": billion * bytes_per_token(cfg.hidden_size, "bf16", 1 + len(aux)) / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    print(figures)
    if cuda:
        write_result(f"online_{args.shape}_{args.variant}", figures)


if __name__ == "__main__":
    main()
