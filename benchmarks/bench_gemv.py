"""The read rate of a decode step's matmuls on their own (#36: a decode step at batch 1 reads at 65.5 %
of the weight-read limit, 75 % asked): each linear map of a target layer and the lm_head, at 1 to 64
rows, as cuBLAS runs it (`F.linear`, what the layers call) and, up to 8 rows, as Inductor's own
reduction kernel (the product summed along K, compiled for the static shape with coordinate-descent
tuning, the GEMV gpt-fast's decoding gets) and, up to 64 rows, as the project's own Triton kernel
(`inference_ref.skinny_linear`: no split-K, each weight read once for every row). 32 and 40 rows are a verify of 4 and 5 tokens at batch 8
(#36: 5–8 tokens cost 1.14× a decode step there, 2–4 tokens 1.07–1.10×). If the layers' maps
alone stay under 75 % with both, the step cannot reach it by fusing what lies between them.

    python -m benchmarks.bench_gemv --shape llama3_8b

Each map is timed over enough distinct weight copies (≥ 512 MB) that no call finds its weight in
the L2 cache (50 MB on an H200; an 8B layer's o_proj is 32 MB), captured as one CUDA graph.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_verify_cost import captured, replay_ms
from benchmarks.common import DEVICE, DTYPE, peak_bandwidth, shape, write_result
from inference_ref import skinny_linear as skinny

ROTATION_BYTES = 512 * 2**20
GEMV_ROWS = 8  # the reduction kernel reads each weight once per row: timed up to this many rows


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear map a Llama-family decode step runs, the lm_head last."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "qkv_proj": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up_proj": (2 * cfg.intermediate_size, h),
        "down_proj": (h, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, h),
    }


def reduction_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ as a product summed along K: Inductor writes it as one reduction kernel
    (accumulating in fp32) instead of calling cuBLAS."""
    return (x[:, None, :] * w[None]).sum(-1)


def call_ms(kernel, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """ms per call of kernel(x, w), each call on the next weight copy, replayed as one graph."""
    graph = captured(lambda: [kernel(x, w) for w in weights])
    return replay_ms(graph, repeats=10) / len(weights)


@torch.inference_mode()
def measure(cfg, batches: list[int], bandwidth: float | None) -> dict:
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = True
    reduction = torch.compile(reduction_gemv, dynamic=False)
    out = {}
    for name, (n, k) in linear_shapes(cfg).items():
        nbytes = n * k * DTYPE.itemsize
        copies = max(2, math.ceil(ROTATION_BYTES / nbytes))
        weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5 for _ in range(copies)]
        out[name] = {"out": n, "in": k, "weight_bytes": nbytes}
        for b in batches:
            x = torch.randn(b, k, device=DEVICE, dtype=DTYPE)
            row = {}
            kernels = {"cublas": F.linear} | ({"inductor_reduction": reduction} if b <= GEMV_ROWS else {})
            kernels |= {"skinny": skinny.skinny_linear} if b <= skinny.MAX_ROWS else {}
            for kernel_name, kernel in kernels.items():
                ms = call_ms(kernel, weights, x)
                rate = nbytes / (ms / 1e3)
                row[kernel_name] = {
                    "ms": ms,
                    "bytes_per_s": rate,
                    "share_of_peak": rate / bandwidth if bandwidth else None,
                }
            out[name][str(b)] = row
            print(name, b, {kn: f"{r['ms'] * 1e3:.1f} us" for kn, r in row.items()}, flush=True)
        del weights
        torch.cuda.empty_cache()
    return out


def step_floor(cfg, per_map: dict, batches: list[int], bandwidth: float | None) -> dict:
    """Per batch and kernel: the ms a decode step's matmuls take (every layer's maps and the lm_head)
    with each map at its measured rate, and that as a share of the same bytes at peak."""
    counts = {name: cfg.num_hidden_layers for name in per_map} | {"lm_head": 1}
    out = {}
    for b in batches:
        out[str(b)] = {}
        for kernel_name in per_map["lm_head"][str(b)]:
            ms = sum(counts[m] * per_map[m][str(b)][kernel_name]["ms"] for m in per_map)
            nbytes = sum(counts[m] * per_map[m]["weight_bytes"] for m in per_map)
            out[str(b)][kernel_name] = {
                "matmul_ms": ms,
                "share_of_peak": nbytes / bandwidth / (ms / 1e3) if bandwidth else None,
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1, 8, 32, 40, 64],
        help="rows per call (batch × new tokens: 40 is a verify of 5 tokens at batch 8)",
    )
    args = p.parse_args()
    cfg = shape(args.shape)
    bandwidth = peak_bandwidth(torch.cuda.get_device_name())
    per_map = measure(cfg, args.batches, bandwidth)
    write_result(
        f"gemv_{args.shape}",
        {
            "command": "python -m benchmarks.bench_gemv " + " ".join(sys.argv[1:]),
            "shape": args.shape,
            "peak_bandwidth_bytes_per_s": bandwidth,
            "maps": per_map,
            "decode_step_matmuls": step_floor(cfg, per_map, args.batches, bandwidth),
        },
    )


if __name__ == "__main__":
    main()
