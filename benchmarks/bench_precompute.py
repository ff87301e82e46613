"""Hidden-state dump: inference_ref's packed forward vs Hugging Face transformers, one run, same weights.

Baseline: transformers' `LlamaModel` with SDPA on length-sorted, right-padded batches (the best
a padded layout gets), last-layer states of the real tokens copied to the host. Ours: packed
varlen batches of the same token budget, states copied to pinned host memory.

    python -m benchmarks.bench_precompute --shape llama3_8b --tokens 600000
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import (
    DEVICE,
    DTYPE,
    hf_copy,
    kernel_profile,
    linear_flops_per_token,
    lognormal_lengths,
    shape,
    timed,
    write_result,
)
from inference_ref.attention import packed_kernel
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models import TARGET_KINDS

# transformers' base model (no lm_head) of each kind, the baseline
HF_BASE = {"llama": "LlamaModel", "qwen3": "Qwen3Model", "qwen3_moe": "Qwen3MoeModel"}

PEAK_BF16 = 797e12  # measured bf16 matmul on this H200 (shared/gpu/README.md)


def padded_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Length-sorted indices grouped so that batch × longest ≤ budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current]


def packed_batches(lengths: list[int], budget: int) -> list[list[int]]:
    batches, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return batches + [current]


def run_hf(hf, seqs, batches) -> float:
    def go():
        for batch in batches:
            width = max(len(seqs[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long, device=DEVICE)
            mask = torch.zeros(len(batch), width, dtype=torch.long, device=DEVICE)
            for row, i in enumerate(batch):
                ids[row, : len(seqs[i])] = seqs[i]
                mask[row, : len(seqs[i])] = 1
            out = hf(input_ids=ids, attention_mask=mask).last_hidden_state
            out[mask.bool()].to("cpu")

    with torch.inference_mode():
        return timed(go)


def run_ours(model, seqs, batches, hidden_size: int) -> float:
    host = torch.empty(max(sum(len(seqs[i]) for i in b) for b in batches), hidden_size, dtype=DTYPE)
    host = host.pin_memory() if DEVICE == "cuda" else host

    def go():
        for batch in batches:
            ids = torch.cat([seqs[i] for i in batch]).to(DEVICE, non_blocking=True)
            cu = cu_seqlens_of([len(seqs[i]) for i in batch], device=DEVICE)
            hidden, _ = model.forward_packed(ids, cu)
            host[: hidden.shape[0]].copy_(hidden, non_blocking=True)

    return timed(go)


def compiled_run(model, seqs, batches, hidden_size: int, warmup: int) -> dict:
    """The packed forward again with its layers compiled (`CausalLM.compile_layers`): throughput,
    compile time (the warm-up's first batch), and how far its states move from the eager ones."""
    probe = seqs[0].to(DEVICE)
    cu = cu_seqlens_of([len(probe)], device=DEVICE)
    eager, _ = model.forward_packed(probe, cu)
    model.compile_layers()
    compile_s = run_ours(model, seqs, batches[:1], hidden_size)
    run_ours(model, seqs, batches[1:warmup], hidden_size)
    seconds = run_ours(model, seqs, batches, hidden_size)
    fused, _ = model.forward_packed(probe, cu)
    return {
        "inference_ref_compiled_tokens_per_s": sum(map(len, seqs)) / seconds,
        "compile_and_first_batch_s": compile_s,
        "compiled_vs_eager_max_rel_diff": float((fused - eager).abs().max() / eager.abs().max()),
    }


def kernel_breakdown(model, seqs, batch: list[int], hidden_size: int) -> dict:
    """GPU time per kernel kind over one batch (torch.profiler), against the batch's wall-clock:
    what the remaining time goes to."""
    run_ours(model, seqs, [batch], hidden_size)
    wall = []
    profiled = kernel_profile(lambda: wall.append(run_ours(model, seqs, [batch], hidden_size)))
    return {"profiled_batch_tokens": sum(len(seqs[i]) for i in batch), "wall_ms": wall[0] * 1e3, **profiled}


@torch.inference_mode()
def check_agreement(model, hf, ids: torch.Tensor) -> float:
    """Max relative difference of final-normed states, ours vs HF, on one sequence (same weights)."""
    ids = ids.to(DEVICE)
    ours, _ = model.forward_packed(ids, cu_seqlens_of([len(ids)], device=DEVICE))
    ref = hf(input_ids=ids[None]).last_hidden_state[0]
    return float((model.norm(ours) - ref).abs().max() / ref.abs().max())


def side_by_side(
    model,
    hf,
    cfg,
    tokens: int,
    batch_tokens: int,
    warmup: int,
    agreement_tokens: int | None = None,
    compiled: bool = False,
) -> dict:
    """Random sequences of lognormal lengths through transformers (length-sorted, padded) and
    through ours (packed), both warmed up on `warmup` batches first; throughputs, HF's padding
    efficiency, and the two models' agreement on the first sequence (its first
    `agreement_tokens`). `compiled`: then ours again with compiled layers, and a kernel-time
    breakdown of one batch of each."""
    lengths = lognormal_lengths(tokens)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    total = sum(lengths)
    hf_batches = padded_batches(lengths, batch_tokens)
    our_batches = packed_batches(lengths, batch_tokens)
    run_hf(hf, seqs, hf_batches[-warmup:])  # kernels, allocator
    run_ours(model, seqs, our_batches[:warmup], cfg.hidden_size)
    agreement = check_agreement(model, hf, seqs[0][:agreement_tokens])
    t_hf = run_hf(hf, seqs, hf_batches)
    t_ours = run_ours(model, seqs, our_batches, cfg.hidden_size)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in hf_batches)
    extra = {}
    if compiled:  # a failure here is reported, not allowed to lose the side-by-side figures
        try:
            extra["profile_eager"] = kernel_breakdown(model, seqs, our_batches[0], cfg.hidden_size)
            extra.update(compiled_run(model, seqs, our_batches, cfg.hidden_size, warmup))
            extra["profile_compiled"] = kernel_breakdown(model, seqs, our_batches[0], cfg.hidden_size)
        except Exception as e:  # noqa: BLE001 (reported in the results)
            extra["compiled_or_profile_error"] = f"{type(e).__name__}: {e}"[:2000]
    return {
        "tokens": total,
        "sequences": len(lengths),
        "batch_tokens": batch_tokens,
        "hf_sorted_padded_tokens_per_s": total / t_hf,
        "hf_pad_efficiency": total / padded,
        "inference_ref_packed_tokens_per_s": total / t_ours,
        "speedup": t_hf / t_ours,
        "max_rel_diff_vs_hf_normed_hidden": agreement,
        **extra,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--tokens", type=int, default=600_000)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=None, help="override depth (quick checks)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled-layers run")
    args = p.parse_args()
    changes = {} if args.layers is None else {"num_hidden_layers": args.layers}
    cfg = shape(args.shape, **changes)
    import transformers

    model = TARGET_KINDS[cfg.model_type].random(cfg, device=DEVICE, dtype=DTYPE)
    hf = hf_copy(model, getattr(transformers, HF_BASE[cfg.model_type]))
    compiled = not args.no_compile and model.compilable
    run = side_by_side(model, hf, cfg, args.tokens, args.batch_tokens, warmup=3, compiled=compiled)
    figures = {"command": "python -m benchmarks.bench_precompute " + " ".join(sys.argv[1:]), **run}
    if not hasattr(cfg, "num_experts") and not hasattr(cfg, "n_routed_experts"):  # dense: the roofline
        flops = linear_flops_per_token(cfg)
        best = max(
            run["inference_ref_packed_tokens_per_s"], run.get("inference_ref_compiled_tokens_per_s", 0)
        )
        figures.update(
            linear_roofline_tokens_per_s=PEAK_BF16 / flops,
            inference_ref_fraction_of_roofline=run["inference_ref_packed_tokens_per_s"] * flops / PEAK_BF16,
            best_fraction_of_roofline=best * flops / PEAK_BF16,
        )
    figures["attention_kernel"] = packed_kernel()
    write_result(
        f"precompute_{args.shape}" + ("" if args.layers is None else f"_{args.layers}layers"), figures
    )


if __name__ == "__main__":
    main()
