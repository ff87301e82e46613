"""Precompute's packed forward with the target sharded over a tensor-parallel group
(`inference_ref.tensor_parallel`), against data parallelism, in one launch:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_tensor_parallel \
        --shape llama3_8b --tokens 300000 --compare-dp
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_tensor_parallel \
        --shape llama3_70b --tokens 120000

The same random token stream (lognormal lengths, packed into `--batch-tokens` batches) goes
through (a) data parallelism: each rank holds the whole target and forwards its half of the batches
(`--compare-dp`, for shapes one GPU holds), then (b) tensor parallelism: each rank holds 1/N of the
target and the group forwards every batch. With `--compare-dp` the sharded target is the whole one
distributed (`parallelize`), so its states are compared with the whole one's; otherwise (70B) its
shards are drawn at random in place (`random_parallel`). The leader copies the states to pinned host
memory, as precompute's writer does. Figures: tokens/s of the group and per GPU, the fraction of the
linear-layer roofline of the GPUs used, peak memory per GPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from benchmarks.bench_precompute import PEAK_BF16, packed_batches
from benchmarks.common import linear_flops_per_token, lognormal_lengths, shape, write_result
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models import TARGET_KINDS
from inference_ref.tensor_parallel import device_mesh, parallelize, random_parallel, weight_bytes_per_rank

GiB = 1 << 30


def forward_all(model, seqs, batches, host: torch.Tensor | None) -> float:
    """Seconds to forward `batches` (all ranks in step), the states copied to `host` if given."""
    device = model.norm.weight.device
    dist.barrier()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for batch in batches:
        ids = torch.cat([seqs[i] for i in batch]).to(device, non_blocking=True)
        hidden, _ = model.forward_packed(ids, cu_seqlens_of([len(seqs[i]) for i in batch], device=device))
        if host is not None:
            host[: hidden.shape[0]].copy_(hidden, non_blocking=True)
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - started


def probe_states(model, seq: torch.Tensor) -> torch.Tensor:
    device = model.norm.weight.device
    hidden, _ = model.forward_packed(seq.to(device), cu_seqlens_of([len(seq)], device=device))
    return model.norm(hidden).float()


def measure(model, seqs, batches, warmup: int, leader: bool, batch_tokens: int) -> float:
    host = torch.empty(batch_tokens + 4096, model.cfg.hidden_size, dtype=torch.bfloat16).pin_memory()
    forward_all(model, seqs, batches[:warmup], host if leader else None)
    return forward_all(model, seqs, batches, host if leader else None)


def rates(tokens: int, seconds: float, gpus: int, cfg) -> dict:
    roofline = gpus * PEAK_BF16 / linear_flops_per_token(cfg)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / gpus,
        "roofline_tokens_per_s": roofline,
        "fraction_of_linear_roofline": tokens / seconds / roofline,
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3_8b")
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--batch-tokens", type=int, default=16_384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compare-dp", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also with compiled layers")
    parser.add_argument(
        "--rank-share",
        type=int,
        default=0,
        help="one GPU runs what one rank of a TP group of this size computes (its heads, MLP columns "
        "and vocabulary rows), without the collectives: the compute side where no group is lent",
    )
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if args.rank_share:
        return rank_share(args)

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", local)
    mesh = device_mesh(world, device)["tp"]
    cfg = shape(args.shape)
    lengths = lognormal_lengths(args.tokens)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    batches = packed_batches(lengths, args.batch_tokens)
    total = sum(lengths)
    figures = {
        "shape": args.shape,
        "gpus": world,
        "tokens": total,
        "batch_tokens": args.batch_tokens,
        "weights_gib_per_gpu_whole": weight_bytes_per_rank(cfg, 1, 2) / GiB,
        "weights_gib_per_gpu_tp": weight_bytes_per_rank(cfg, world, 2) / GiB,
    }

    if args.compare_dp:  # (a) each rank the whole target, half of the batches
        torch.manual_seed(0)
        model = TARGET_KINDS[cfg.model_type].random(cfg, device, torch.bfloat16, 0)
        mine = batches[rank::world]
        torch.cuda.reset_peak_memory_stats()
        seconds = measure(model, seqs, mine, args.warmup, True, args.batch_tokens)
        figures["data_parallel"] = {
            **rates(total, seconds, world, cfg),
            "peak_gib_per_gpu": torch.cuda.max_memory_allocated() / GiB,
        }
        reference = probe_states(model, seqs[0])
        model = parallelize(model, mesh)  # the same weights, sharded
        torch.cuda.empty_cache()
    else:
        model = random_parallel(cfg, mesh, device, torch.bfloat16)

    torch.cuda.reset_peak_memory_stats()
    seconds = measure(model, seqs, batches, args.warmup, rank == 0, args.batch_tokens)
    figures["tensor_parallel"] = {
        **rates(total, seconds, world, cfg),
        "peak_gib_per_gpu": torch.cuda.max_memory_allocated() / GiB,
    }
    if args.compare_dp:
        sharded = probe_states(model, seqs[0])
        figures["tp_vs_whole_max_rel_diff_normed_hidden"] = float(
            (sharded - reference).abs().max() / reference.abs().max()
        )
        figures["tp_vs_dp_throughput"] = (
            figures["tensor_parallel"]["tokens_per_s"] / figures["data_parallel"]["tokens_per_s"]
        )
    if args.compile:
        try:
            model.compile_layers()
            seconds = measure(model, seqs, batches, args.warmup, rank == 0, args.batch_tokens)
            figures["tensor_parallel_compiled"] = {
                **rates(total, seconds, world, cfg),
                "forwards_that_fell_back_to_eager": sorted(model.compile_failed),
            }
        except Exception as e:  # noqa: BLE001 (reported, the eager figures kept)
            figures["tensor_parallel_compiled_error"] = f"{type(e).__name__}: {e}"[:1500]
    if rank == 0:
        write_result(args.name or f"tensor_parallel_{args.shape}_tp{world}", figures)
    dist.destroy_process_group()


def rank_share(args) -> None:
    """One rank's share of a TP group of `args.rank_share` on one GPU: the shape with 1/N of the
    heads, KV heads, MLP columns and vocabulary, forwarded whole; its tokens/s is what the group
    would reach if its all-reduces cost nothing."""
    n = args.rank_share
    full = shape(args.shape)
    cfg = shape(
        args.shape,
        num_attention_heads=full.num_attention_heads // n,
        num_key_value_heads=full.num_key_value_heads // n,
        intermediate_size=full.intermediate_size // n,
        vocab_size=full.vocab_size // n,
    )
    lengths = lognormal_lengths(args.tokens)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (k,), generator=g) for k in lengths]
    batches = packed_batches(lengths, args.batch_tokens)
    total = sum(lengths)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 70B share in fp32 first would not fit
    model = TARGET_KINDS[cfg.model_type].random(cfg, "cuda", torch.bfloat16, 0)
    torch.set_default_dtype(torch.float32)
    host = torch.empty(args.batch_tokens + 4096, cfg.hidden_size, dtype=torch.bfloat16).pin_memory()
    figures = {"shape": args.shape, "rank_share_of_tp": n, "tokens": total, "batch_tokens": args.batch_tokens}
    for compiled in (False, True) if args.compile else (False,):
        if compiled:
            model.compile_layers()
        run = [lambda b=b: model.forward_packed(*packed(b, seqs)) for b in batches]
        for step in run[: args.warmup]:
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for step in run:
            hidden, _ = step()
            host[: hidden.shape[0]].copy_(hidden, non_blocking=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        # the group's throughput if collectives were free: each of its n GPUs forwards every token
        figures["compiled" if compiled else "eager"] = {
            **rates(total, seconds, n, full),
            "peak_gib_this_gpu": torch.cuda.max_memory_allocated() / GiB,
        }
    figures["weights_gib_per_gpu"] = weight_bytes_per_rank(cfg, 1, 2) / GiB
    write_result(args.name or f"tensor_parallel_{args.shape}_rank_share_of_tp{n}", figures)


def packed(batch: list[int], seqs) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([seqs[i] for i in batch]).to("cuda", non_blocking=True)
    return ids, cu_seqlens_of([len(seqs[i]) for i in batch], device="cuda")


if __name__ == "__main__":
    main()
