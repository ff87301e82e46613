"""Qwen3 target (dense: Qwen3-0.6B … 32B): a Llama-family layer whose per-head queries and keys are
RMS-normalized (`q_norm`, `k_norm`, over `head_dim`) before rotary, with an explicit `head_dim` and,
in the small sizes, tied embeddings. Everything else is the Llama module's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from inference_ref.causal_lm import CausalLM, KVCache, RMSNorm, config_fingerprint
from inference_ref.loading import read_tensors, safetensors_files
from inference_ref.models import llama


@dataclass(frozen=True)
class Qwen3Config(llama.LlamaConfig):
    """Shape of a `Qwen3ForCausalLM` checkpoint (the Llama fields; q/k norms are implied)."""

    model_type: ClassVar[str] = "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> Qwen3Config:
        unsupported = {
            "attention_bias must be false": bool(hf.get("attention_bias")),
            "use_sliding_window must be false": bool(hf.get("use_sliding_window")),
            "hidden_act must be silu": hf.get("hidden_act", "silu") != "silu",
        }
        problems = [what for what, bad in unsupported.items() if bad]
        if problems:
            raise ValueError(f"config.json: unsupported Qwen3 options: {'; '.join(problems)}")
        return cls(**asdict(llama.LlamaConfig.from_hf(hf)))

    def to_hf(self) -> dict:
        return {
            **super().to_hf(),
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "attention_bias": False,
            "use_sliding_window": False,
        }

    def fingerprint(self) -> str:
        return config_fingerprint({"model_type": self.model_type, **asdict(self)})


class Qwen3Attention(llama.Attention):
    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def heads(
        self, x: torch.Tensor, norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x, norm)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Model(CausalLM):
    """`Qwen3ForCausalLM` with fused projections."""

    split_kv_attention = True  # llama's attention
    passes_norms = True  # llama's DecoderLayer

    def __init__(self, cfg: Qwen3Config):
        layers = [llama.DecoderLayer(cfg, Qwen3Attention) for _ in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, llama.Rotary(cfg), KVCache)


def load_qwen3(path: str | Path, device="cpu", dtype=torch.float32) -> Qwen3Model:
    """Load a target from a Hugging Face directory (safetensors, read by tensor name)."""
    path = Path(path)
    cfg = Qwen3Config.from_hf(json.loads((path / "config.json").read_text()))
    hf = read_tensors(path, [n for n in safetensors_files(path) if not n.endswith("rotary_emb.inv_freq")])
    return llama.build_model(cfg, llama.fuse_hf_state_dict(hf, cfg), device, dtype, Qwen3Model)


random_qwen3 = partial(llama.random_llama, model_class=Qwen3Model)
hf_state_dict = llama.hf_state_dict  # the q/k norms travel as `EXTRA_LAYER_TENSORS`


def head_layer(cfg: Qwen3Config, mlp: str) -> tuple[nn.Module, nn.Module, type]:
    """The serving head's Qwen3 decoder layer (q/k norms), rotary table and cache type."""
    return llama.DecoderLayer(cfg, Qwen3Attention), llama.Rotary(cfg), KVCache


fuse_head_layer = llama.fuse_head_layer  # the q/k norms pass through under their names

# The debug shape: the Llama one with a head_dim that is not hidden / heads, as Qwen3's sizes have.
TINY = {**llama.TINY, "head_dim": 32, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
