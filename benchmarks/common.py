"""Shared pieces of the GPU benchmarks: shapes, token streams, timing, JSON results."""

from __future__ import annotations

import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from inference_ref.models.llama import LlamaConfig

SHAPES = {
    "llama3_8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "llama3_70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    # Qwen3-8B's and Qwen3-30B-A3B's config.json (Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B), the fields read.
    "qwen3_8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
    "smollm2_135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}

# DeepSeek-V2-Lite's config.json on the hub (deepseek-ai/DeepSeek-V2-Lite), the fields the code reads.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "hidden_act": "silu",
    "attention_bias": False,
}

RESULTS = Path(__file__).parent / "results"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def hf_copy(model, hf_class):
    """A transformers model of class `hf_class` (SDPA) holding `model`'s weights, on DEVICE in DTYPE;
    its config is transformers' own class for the model's kind."""
    from transformers import AutoConfig

    from inference_ref.models import TARGET_KINDS

    hf_cfg = model.cfg.to_hf()
    config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg, attn_implementation="sdpa")
    torch.set_default_dtype(DTYPE)
    with torch.device(DEVICE):
        hf = hf_class(config).eval()
    torch.set_default_dtype(torch.float32)
    weights = TARGET_KINDS[model.cfg.model_type].hf_state_dict(model)
    if any(k.endswith("experts.gate_up_proj") for k in hf.state_dict()):  # transformers 5 stacks experts
        weights = stacked_experts(weights)
    if not hasattr(hf, "lm_head"):  # a bare LlamaModel: no lm_head, no "model." prefix
        weights = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
    hf.load_state_dict(weights, strict=not (hasattr(hf, "lm_head") and model.cfg.tie_word_embeddings))
    return hf


def stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`….mlp.experts.{e}.{gate,up,down}_proj.weight`) → the stacked
    `….mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] transformers 5 holds."""
    import re

    pattern = re.compile(r"(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out, experts = {}, {}
    for name, t in weights.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(n)]
        )
        out[prefix + "down_proj"] = torch.stack([parts[(e, "down")] for e in range(n)])
    return out


def shape(name: str, **changes):
    """The config of a named shape, of its kind (`model_type`, Llama when absent)."""
    from inference_ref.models import TARGET_KINDS

    fields = {**SHAPES[name], **changes}
    return TARGET_KINDS[fields.pop("model_type", "llama")].config(**fields)


def lognormal_lengths(total_tokens: int, median: int = 600, cap: int = 4096, seed: int = 0) -> list[int]:
    """Sample lengths (lognormal, σ = 1, capped) until `total_tokens` is reached."""
    rng = np.random.default_rng(seed)
    out, used = [], 0
    while used < total_tokens:
        n = int(min(cap, max(16, rng.lognormal(np.log(median), 1.0))))
        out.append(n)
        used += n
    return out


def linear_flops_per_token(cfg: LlamaConfig) -> float:
    """2 × parameters of the layers' linear maps (attention and MLP), per token."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return 2.0 * per_layer * cfg.num_hidden_layers


# Peak HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name(), from the vendor's
# data sheets (SXM parts): what a memory-bound decode step is held against.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12, "B200": 8.0e12}


def peak_bandwidth(device_name: str) -> float | None:
    """The data sheet's bytes/s for a device name, or None for a device not in PEAK_BANDWIDTH."""
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in device_name), None)


def decode_read_bytes(cfg, batch: int, context: int, bytes_per_value: int = 2) -> int | None:
    """The bytes one decode step of a dense target must read: every weight once, except an untied
    embedding table (a step gathers one row per token; a tied table is read whole as the lm_head),
    plus each row's K and V of `context` tokens in every layer. None for kinds whose step reads
    only some of its weights (MoE) or caches a latent instead of K and V (MLA)."""
    from inference_ref.tensor_parallel import weight_bytes_per_rank

    if cfg.model_type not in ("llama", "qwen3"):
        return None
    weights = weight_bytes_per_rank(cfg, 1, bytes_per_value)
    if not cfg.tie_word_embeddings:
        weights -= cfg.vocab_size * cfg.hidden_size * bytes_per_value
    kv = (
        batch * cfg.num_hidden_layers * 2 * context * cfg.num_key_value_heads * cfg.head_dim * bytes_per_value
    )
    return weights + kv


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU-only machine)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Wall-clock seconds of fn(), with the GPU drained before and after."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


KERNEL_KINDS = (  # (kind, substrings of the CUDA kernel name), first match wins
    ("attention", ("flash", "fmha", "attention")),  # before matmul: its name holds "cutlass"
    ("matmul", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas")),
    ("fused elementwise (triton)", ("triton",)),
    ("copy", ("copy", "memcpy", "memset", "catarray", "concat")),
)
OWN_KERNELS = {"_qkv_rope_cache": "matmul", "_silu_gate_up": "matmul"}
"""The project's Triton kernels the table would miss, by name prefix (Inductor's kernels fused
around them carry their names inside, never at the start): q|k|v's map with its rotary epilogue,
gate_up's with SiLU·up in its epilogue (until 2026-12-07 counted as "other elementwise", which
left 2.5 ms of a verify's maps out of `matmul_share_of_peak`)."""


def kernel_profile(fn, top: int = 15) -> dict:
    """GPU time per kernel kind while fn() runs (torch.profiler; kernels replayed from a CUDA graph
    are traced one by one too), the busy total, and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = next((k for p, k in OWN_KERNELS.items() if name.startswith(p)), None) or next(
            (k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "other elementwise"
        )
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        kernels.append((us / 1e3, event.key[:90], event.count))
    return {
        "gpu_busy_ms": sum(kinds.values()),
        "kernel_calls": sum(calls for _, _, calls in kernels),
        "ms_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"ms": ms, "name": n, "calls": c} for ms, n, c in sorted(kernels, reverse=True)[:top]
        ],
    }


def inductor_autotune() -> None:
    """Inductor's GEMM autotuning (its Triton templates timed against cuBLAS for each static shape,
    e.g. a batch-1 decode's M = 1) and coordinate-descent tuning of the kernels it generates, as
    gpt-fast compiles decoding. Compiles take minutes instead of seconds; the question it answers is
    whether a decode step at batch 1 gets closer to the weight-read limit (#36: 75 %)."""
    import torch._inductor.config as inductor

    inductor.max_autotune_gemm = True
    inductor.coordinate_descent_tuning = True


def strict_compile(limit: int = 64) -> None:
    """Let one function compile for up to `limit` shapes (a benchmark's grid of batches and token
    counts), and make passing that an error: past Dynamo's limit a compiled function runs eagerly
    without a word, and a benchmark would time the eager code under the compiled code's name."""
    import torch._dynamo.config as dynamo

    if hasattr(dynamo, "recompile_limit"):
        dynamo.recompile_limit = limit
    else:  # torch < 2.6
        dynamo.cache_size_limit = limit
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):
        dynamo.fail_on_recompile_limit_hit = True


def write_result(name: str, figures: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        **figures,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    return path
