"""Shared pieces of the GPU benchmarks: shapes, token streams, timing, JSON results."""

from __future__ import annotations

import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from inference_ref.config import LlamaConfig

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

RESULTS = Path(__file__).parent / "results"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def hf_copy(model, hf_class):
    """A transformers model of class `hf_class` (SDPA) holding `model`'s weights, on DEVICE in DTYPE."""
    from transformers import LlamaConfig as HFConfig

    from inference_ref.loading import hf_state_dict

    torch.set_default_dtype(DTYPE)
    with torch.device(DEVICE):
        hf = hf_class(HFConfig(**model.cfg.to_hf(), attn_implementation="sdpa")).eval()
    torch.set_default_dtype(torch.float32)
    weights = hf_state_dict(model)
    if not hasattr(hf, "lm_head"):  # a bare LlamaModel: no lm_head, no "model." prefix
        weights = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
    hf.load_state_dict(weights, strict=not (hasattr(hf, "lm_head") and model.cfg.tie_word_embeddings))
    return hf


def shape(name: str, **changes) -> LlamaConfig:
    return LlamaConfig(**{**SHAPES[name], **changes})


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


def timed(fn) -> float:
    """Wall-clock seconds of fn(), with the GPU drained before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


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
