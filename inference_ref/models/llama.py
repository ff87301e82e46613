"""Llama-family target (Llama 2/3.x, SmolLM2, ...): config, layers and weights.

Projections are fused (q|k|v and gate|up) so each layer runs two large matmuls where the
checkpoint has five. Loaded from a Hugging Face directory (safetensors); GGUF files through `inference_ref.gguf`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from inference_ref.attention import cached_attention, packed_causal_attention
from inference_ref.causal_lm import (
    CausalLM,
    Fp32Frequencies,
    KVCache,
    NormedRows,
    RMSNorm,
    config_fingerprint,
    eos_token_ids,
    residual_stream,
)
from inference_ref.loading import EMBED, FINAL_NORM, LM_HEAD, init_random, read_tensors, safetensors_files
from inference_ref.skinny_linear import project, project_mlp, project_qkv
from inference_ref.split_kv_attention import split_kv_attention

# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x `llama3` rope scaling (`rope_type: llama3`); absent for plain RoPE."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
        return config_fingerprint(asdict(self))


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


# ---------------------------------------------------------------------------------------------
# The model


class Rotary(Fp32Frequencies):
    """cos/sin tables for given positions, in the `rotate_half` convention."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, d]; cos/sin [..., T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def heads(
        self, x: torch.Tensor, norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [.., heads, d], k and v [.., kv_heads, d] of norm(x) (x where None), before rotary (a
        kind may normalize them here)."""
        q, k, v = project(self.qkv_proj, x, norm).split(
            [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1
        )
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        k = k.unflatten(-1, (self.n_kv, self.head_dim))
        return q, k, v.unflatten(-1, (self.n_kv, self.head_dim))

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None = None):
        q, k, v = self.heads(x, norm)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward_packed(self, x, cos, sin, cu_seqlens, max_len):
        q, k, v = self._qkv(x, cos, sin)
        o = packed_causal_attention(q, k, v, cu_seqlens, max_len)
        return self.o_proj(o.flatten(-2))

    def forward_cached(
        self, x, cos, sin, k_cache, v_cache, slots, mask, norm=None, residual=None, norm_after=None
    ):
        """x [B, S, H] → residual + attention(norm(x)) (None: left out); writes the new K/V at
        `slots` [B, S] of this layer's cache, then attends. No mask: a consecutive run, each token
        seeing the keys up to its own slot (`Placement`). The norm, rotary, cache writes and the
        residual add go into the maps' kernels where they fold (`skinny_linear.use_linear_kernel`;
        not under a kind's own `heads`, e.g. Qwen3's q/k norms). x may come with half of its norm
        done (`NormedRows`). norm_after: the norm the caller applies next, which o_proj may start
        (`skinny_linear.project`: then `NormedRows`)."""
        q = None
        if type(self).heads is Attention.heads:
            q = project_qkv(self.qkv_proj, x, norm, cos, sin, k_cache, v_cache, slots)
        if q is None:
            x = residual_stream(x)  # its norm, if the map before began it, runs here whole
            q, k, v = self._qkv(x, cos, sin, norm)
            rows = torch.arange(x.shape[0], device=x.device)[:, None]
            k_cache[rows, slots] = k.to(k_cache.dtype)
            v_cache[rows, slots] = v.to(v_cache.dtype)
        if mask is None:
            o = split_kv_attention(q, k_cache, v_cache, slots[:, 0])
        else:
            key_len = mask.shape[-1]
            o = cached_attention(q, k_cache[:, :key_len], v_cache[:, :key_len], mask)
        return project(self.o_proj, o.flatten(-2), residual=residual, norm_after=norm_after)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor | NormedRows,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
        norm_after: RMSNorm | None = None,
    ) -> torch.Tensor | NormedRows:
        """residual + mlp(norm(x)) (None: left out); the norm, the activation and the residual in
        the maps' kernels where they fold (`skinny_linear.project_mlp`; x may come with half of
        its norm done, and the result with half of norm_after's, `NormedRows`)."""
        return project_mlp(self.gate_up_proj, self.down_proj, x, norm, residual, norm_after)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: type[Attention] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward_packed(self, x, cos, sin, cu_seqlens, max_len):
        x = x + self.self_attn.forward_packed(self.input_layernorm(x), cos, sin, cu_seqlens, max_len)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def forward_cached(self, x, cos, sin, k_cache, v_cache, slots, mask, norm_after=None):
        # as forward_packed, with the norms and residual adds handed to the maps that fold them;
        # a tile's norms split between the maps before and after them where they take it
        # (`skinny_linear.NormedRows`): x may come with half of input_layernorm done, and the
        # result with half of norm_after's (the next layer's input_layernorm)
        norm = self.post_attention_layernorm
        gated = isinstance(self.mlp, MLP)  # another kind's MLP (Qwen3-MoE's experts) takes h whole
        h = self.self_attn.forward_cached(
            x, cos, sin, k_cache, v_cache, slots, mask, self.input_layernorm, residual_stream(x),
            norm if gated else None,
        )  # fmt: skip
        if not gated:
            return self.mlp(h, h, norm)
        return self.mlp(h, residual_stream(h), norm, norm_after)


class LlamaModel(CausalLM):
    """`LlamaForCausalLM` with fused projections; embeddings tied or not as configured."""

    split_kv_attention = True
    passes_norms = True  # DecoderLayer.forward_cached's norm_after

    def __init__(self, cfg: LlamaConfig):
        layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, Rotary(cfg), KVCache)


# ---------------------------------------------------------------------------------------------
# Weights: Hugging Face names ↔ this model's fused ones


def fuse_layer(hf: dict[str, torch.Tensor], p: str, q: str) -> dict[str, torch.Tensor]:
    """One decoder layer's Hugging Face tensors under prefix `p` → this model's names under `q`,
    fusing q|k|v and gate|up. An input_layernorm the checkpoint lacks (an eagle1 head's) stays out."""
    out = {
        q + "self_attn.qkv_proj.weight": torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0),
        q + "self_attn.o_proj.weight": hf[p + "self_attn.o_proj.weight"],
        q + "post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
    }
    if p + "mlp.gate_proj.weight" in hf:  # a dense MLP (a MoE layer's experts are its kind's to fuse)
        gate_up = [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        out[q + "mlp.gate_up_proj.weight"] = torch.cat(gate_up, 0)
        out[q + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
    for name in ("input_layernorm.weight", *EXTRA_LAYER_TENSORS):  # those the checkpoint has
        if p + name in hf:
            out[q + name] = hf[p + name]
    return out


# Per-layer tensors a Llama-family kind may add, loaded under their own names (Qwen3's q/k norms).
EXTRA_LAYER_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names → this model's names, fusing q|k|v and gate|up."""
    out = {
        "embed_tokens.weight": hf[EMBED],
        "norm.weight": hf[FINAL_NORM],
        "lm_head.weight": hf[EMBED] if cfg.tie_word_embeddings else hf[LM_HEAD],
    }
    for i in range(cfg.num_hidden_layers):
        out.update(fuse_layer(hf, f"model.layers.{i}.", f"layers.{i}."))
    return out


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """This model's fused weights back under Hugging Face Llama names (unfused)."""
    cfg = model.cfg
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    q_rows = cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = sd[q + "self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
        out.update(
            {
                p + "self_attn.q_proj.weight": wq.contiguous(),
                p + "self_attn.k_proj.weight": wk.contiguous(),
                p + "self_attn.v_proj.weight": wv.contiguous(),
                p + "self_attn.o_proj.weight": sd[q + "self_attn.o_proj.weight"],
                p + "input_layernorm.weight": sd[q + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": sd[q + "post_attention_layernorm.weight"],
            }
        )
        if q + "mlp.gate_up_proj.weight" in sd:  # a dense MLP (a MoE layer's are its kind's)
            gate, up = sd[q + "mlp.gate_up_proj.weight"].chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = (
                gate.contiguous(),
                up.contiguous(),
            )
            out[p + "mlp.down_proj.weight"] = sd[q + "mlp.down_proj.weight"]
        out.update({p + n: sd[q + n] for n in EXTRA_LAYER_TENSORS if q + n in sd})
    return out


def build_model(
    cfg: LlamaConfig, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32, model_class=None
) -> LlamaModel:
    """Assemble a model (`LlamaModel`, or a Llama-family kind's `model_class`) from a fused state dict
    without allocating random weights first."""
    with torch.device("meta"):
        model = (model_class or LlamaModel)(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg)  # its frequencies stay fp32 through the cast below
    model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


def load_llama(path: str | Path, device="cpu", dtype=torch.float32) -> LlamaModel:
    """Load a target from a Hugging Face directory (a `.gguf` file: `inference_ref.gguf.load_gguf`)."""
    path = Path(path)
    cfg = read_config(path)
    where = safetensors_files(path)
    hf = read_tensors(path, [n for n in where if not n.endswith("rotary_emb.inv_freq")])
    return build_model(cfg, fuse_hf_state_dict(hf, cfg), device, dtype)


def random_llama(
    cfg: LlamaConfig, device="cpu", dtype=torch.float32, seed: int = 0, model_class=None
) -> LlamaModel:
    """Random weights at a given shape (benchmarks, tiny test targets)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = (model_class or LlamaModel)(cfg)
    init_random(model)
    model.to(dtype=dtype)
    return model.eval().requires_grad_(False)  # inference only: outputs never need autograd


# ---------------------------------------------------------------------------------------------
# A draft head's layer of this kind (inference_ref.draft builds it through the registry)


def head_layer(cfg: LlamaConfig, mlp: str) -> tuple[nn.Module, nn.Module, type]:
    """The serving head's decoder layer, rotary table and cache type (Llama has a dense MLP only)."""
    return DecoderLayer(cfg), Rotary(cfg), KVCache


def fuse_head_layer(tensors: dict[str, torch.Tensor], cfg: LlamaConfig, mlp: str) -> dict[str, torch.Tensor]:
    """A native head's `layer.*` tensors (checkpoint names) → the serving layer's fused names."""
    return fuse_layer(tensors, "layer.", "layer.")


# The debug shape (tests and CPU runs): two layers, GQA, tied embeddings.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
