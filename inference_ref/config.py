"""The Llama-family target's configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x `llama3` rope scaling (`rope_type: llama3`); absent for plain RoPE."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def eos_token_ids(hf: dict) -> tuple[int, ...]:
    """config.json's `eos_token_id` (one id, a list, or absent) as a tuple."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a `LlamaForCausalLM` checkpoint (Llama 2/3.x, SmolLM2, ...)."""

    model_type: ClassVar[str] = "llama"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """Build from the dict of a Hugging Face `config.json` (transformers 4.x or 5.x keys)."""
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (default, llama3)")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
        eos = eos_token_ids(hf)
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def to_hf(self) -> dict:
        """The `config.json` dict transformers' `LlamaForCausalLM` reads back to this shape."""
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        return hf

    def fingerprint(self) -> str:
        """A short hash of the shape, recorded in stores and exported heads to match them to targets."""
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_config(path: str | Path) -> LlamaConfig:
    """Read `config.json` from a checkpoint directory."""
    file = Path(path) / "config.json"
    return LlamaConfig.from_hf(json.loads(file.read_text()))


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with `llama3` scaling applied where configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
