"""FP8 target against bf16, one run, same weights: packed-forward tokens/s with compiled layers,
peak memory, and how far the FP8 target's final-normed states are from bf16's; FP8 with every
partial sum promoted, with fast accumulation (the default), and with static input scales.

    python -m benchmarks.bench_fp8 --shape llama3_8b --tokens 200000
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_precompute import PEAK_BF16, kernel_breakdown, packed_batches, run_ours
from benchmarks.common import DEVICE, DTYPE, linear_flops_per_token, lognormal_lengths, shape, write_result
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models import TARGET_KINDS
from inference_ref.quantization import Fp8Linear, calibration, quantize


def measure(model, seqs, batches, hidden: int) -> dict:
    torch.cuda.reset_peak_memory_stats()
    model.compile_layers()
    compile_s = run_ours(model, seqs, batches[:1], hidden)
    run_ours(model, seqs, batches[1:3], hidden)
    seconds = run_ours(model, seqs, batches, hidden)
    return {
        "tokens_per_s": sum(map(len, seqs)) / seconds,
        "compile_and_first_batch_s": compile_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "compiled_layers_ran": model.runs_compiled("packed"),
    }


@torch.inference_mode()
def agreement(model, reference: torch.Tensor, ids: torch.Tensor) -> dict:
    out, _ = model.forward_packed(ids, cu_seqlens_of([len(ids)], device=DEVICE))
    a, b = model.norm(out).float(), reference.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {
        "max_rel_err_normed": float((a - b).abs().max() / b.abs().max()),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
    }


def variant(model, seqs, batches, hidden: int, ref, probe, bf16: dict) -> dict:
    """One FP8 variant of the model as it now stands, compiled afresh: speed, agreement with bf16,
    the ratio to bf16 and its kernel profile."""
    model.compile_proven, model.compile_failed = frozenset(), frozenset()
    figures = {**measure(model, seqs, batches, hidden), **agreement(model, ref, probe)}
    figures["vs_bf16"] = figures["tokens_per_s"] / bf16["tokens_per_s"]
    figures["profile"] = kernel_breakdown(model, seqs, batches[0], hidden)
    return figures


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--batch-tokens", type=int, default=32768)
    args = p.parse_args()
    cfg = shape(args.shape)
    model = TARGET_KINDS[cfg.model_type].random(cfg, device=DEVICE, dtype=DTYPE)
    lengths = lognormal_lengths(args.tokens)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    batches = packed_batches(lengths, args.batch_tokens)
    probe = seqs[0].to(DEVICE)
    with torch.inference_mode():
        ref, _ = model.forward_packed(probe, cu_seqlens_of([len(probe)], device=DEVICE))
        ref = model.norm(ref)
    bf16 = measure(model, seqs, batches, cfg.hidden_size)
    torch.cuda.empty_cache()
    quantize(model)
    for module in model.modules():  # first with every partial sum promoted to fp32
        if isinstance(module, Fp8Linear):
            module.fast_accum = False
    model.compile_proven, model.compile_failed = frozenset(), frozenset()
    fp8 = measure(model, seqs, batches, cfg.hidden_size)
    fp8_agreement = agreement(model, ref, probe)
    profile = kernel_breakdown(model, seqs, batches[0], cfg.hidden_size)
    for module in model.modules():  # the same weights with Hopper's fast accumulation
        if isinstance(module, Fp8Linear):
            module.fast_accum = True
    fast = variant(model, seqs, batches, cfg.hidden_size, ref, probe, bf16)
    # The same weights with static input scales (one per map, calibrated eagerly on the first
    # batch's tokens, the measured passes' own), fast accumulation: the e4m3 cast fuses into its
    # producer. The compiled frames are dropped first and traced again after calibration.
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.static_input = True
    torch._dynamo.reset()
    with calibration(model):
        run_ours(model, seqs, batches[:1], cfg.hidden_size)
    static = variant(model, seqs, batches, cfg.hidden_size, ref, probe, bf16)
    flops = linear_flops_per_token(cfg)
    write_result(
        f"fp8_{args.shape}",
        {
            "command": "python -m benchmarks.bench_fp8 " + " ".join(sys.argv[1:]),
            "tokens": sum(lengths),
            "bf16_compiled": bf16,
            "fp8_compiled": fp8,
            "fp8_vs_bf16": fp8["tokens_per_s"] / bf16["tokens_per_s"],
            "bf16_linear_roofline_tokens_per_s": PEAK_BF16 / flops,
            "fp8_past_bf16_roofline": fp8["tokens_per_s"] / (PEAK_BF16 / flops),
            **fp8_agreement,
            "fp8_profile": profile,
            "fp8_fast_accum": fast,
            "fp8_static_inputs": static,
        },
    )


if __name__ == "__main__":
    main()
