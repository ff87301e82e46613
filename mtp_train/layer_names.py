"""Checkpoint name tables of a head's decoder layer: one leaf module read alike by the training heads
(`mtp_train.heads.*.native_block`, the native format's `layer.*` names), the native export and the
engine layouts (`mtp_train.serving.layouts`). It imports no training, export or serving code.

Shapes are symbolic (`"H"`, `"QD"`, ...) and resolved against the target's dimensions by `resolve`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from inference_ref.models.llama import LlamaConfig

Symbolic = dict[str, tuple[str, ...]]
Table = dict[str, tuple[int, ...]]


def llama_dims(cfg: LlamaConfig) -> dict[str, int]:
    """Symbols of the Llama-kind tables."""
    h = cfg.hidden_size
    return {
        "H": h,
        "2H": 2 * h,
        "I": cfg.intermediate_size,
        "V": cfg.vocab_size,
        "QD": cfg.num_attention_heads * cfg.head_dim,
        "KVD": cfg.num_key_value_heads * cfg.head_dim,
    }


def resolve(symbolic: Symbolic, dims: Mapping[str, int], prefix: str = "") -> Table:
    return {prefix + name: tuple(dims[d] for d in shape) for name, shape in symbolic.items()}


def check_layout(tensors: Mapping[str, torch.Tensor], table: Table, what: str = "layout") -> None:
    """Raise unless `tensors` has exactly the names of `table`, each with its shape."""
    missing = sorted(set(table) - set(tensors))
    extra = sorted(set(tensors) - set(table))
    wrong = [
        f"{n} {tuple(tensors[n].shape)} (expected {table[n]})"
        for n in sorted(set(table) & set(tensors))
        if tuple(tensors[n].shape) != table[n]
    ]
    if missing or extra or wrong:
        raise ValueError(f"{what}: missing {missing}, unexpected {extra}, wrong shapes {wrong}")


# ---------------------------------------------------------------------------------------------
# The Llama decoder layer under Hugging Face names, as both engines' Llama loaders read it
# (q/k/v and gate/up are fused at load time by their stacked_params_mapping).
LLAMA_BLOCK: Symbolic = {
    "self_attn.q_proj.weight": ("QD", "H"),
    "self_attn.k_proj.weight": ("KVD", "H"),
    "self_attn.v_proj.weight": ("KVD", "H"),
    "self_attn.o_proj.weight": ("H", "QD"),
    "post_attention_layernorm.weight": ("H",),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}


# A DFlash draft layer (vLLM 0.32 `qwen3_dflash.py` `DFlashQwen3DecoderLayer`, checkpoint names as
# SpecForge and ModelOpt export them): Qwen3's layer, input_layernorm and per-head q/k norms included.
DFLASH_LAYER: Symbolic = {
    **LLAMA_BLOCK,
    "input_layernorm.weight": ("H",),
    "self_attn.q_norm.weight": ("D",),
    "self_attn.k_norm.weight": ("D",),
}


# EAGLE-3's decoder layer: q/k/v read 2H ([input_layernorm(embed); hidden_norm(g)]); `serving.layouts`
# cites the engine loaders it was read from.
EAGLE3_BLOCK: Symbolic = {
    "self_attn.q_proj.weight": ("QD", "2H"),
    "self_attn.k_proj.weight": ("KVD", "2H"),
    "self_attn.v_proj.weight": ("KVD", "2H"),
    "self_attn.o_proj.weight": ("H", "QD"),
    "input_layernorm.weight": ("H",),
    "hidden_norm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}


# A layer stacked after EAGLE-3's first (vLLM llama_eagle3.py, layer_idx ≥ 1): Llama's, reading H.
# The engine's own copy also holds an unused hidden_norm, which only its layout writes.
EAGLE3_LATER_BLOCK: Symbolic = {**LLAMA_BLOCK, "input_layernorm.weight": ("H",)}


# The DeepSeek-V2/V3 decoder layer, read from vLLM vllm/model_executor/models/deepseek_v2.py
# (DeepseekV2MLAAttention, DeepseekV2MoE, DeepseekV2MLP; checkpoint names before vLLM's fusions).
DEEPSEEK_Q_FULL: Symbolic = {"self_attn.q_proj.weight": ("NQK", "H")}
DEEPSEEK_Q_LORA: Symbolic = {
    "self_attn.q_a_proj.weight": ("QR", "H"),
    "self_attn.q_a_layernorm.weight": ("QR",),
    "self_attn.q_b_proj.weight": ("NQK", "QR"),
}
DEEPSEEK_KV_O: Symbolic = {
    "self_attn.kv_a_proj_with_mqa.weight": ("KVR+R", "H"),
    "self_attn.kv_a_layernorm.weight": ("KVR",),
    "self_attn.kv_b_proj.weight": ("NKV", "KVR"),
    "self_attn.o_proj.weight": ("H", "NV"),
    "input_layernorm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
}
DEEPSEEK_DENSE_MLP: Symbolic = {
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}
DEEPSEEK_MOE: Symbolic = {
    "mlp.gate.weight": ("E", "H"),
    "mlp.shared_experts.gate_proj.weight": ("SI", "H"),
    "mlp.shared_experts.up_proj.weight": ("SI", "H"),
    "mlp.shared_experts.down_proj.weight": ("H", "SI"),
}
DEEPSEEK_EXPERT: Symbolic = {
    "mlp.experts.{e}.gate_proj.weight": ("MI", "H"),
    "mlp.experts.{e}.up_proj.weight": ("MI", "H"),
    "mlp.experts.{e}.down_proj.weight": ("H", "MI"),
}
DEEPSEEK_NOAUX: Symbolic = {"mlp.gate.e_score_correction_bias": ("E",)}  # V3 routing (topk_method noaux_tc)
# The routed experts stacked, as a native MoE head holds them (transformers 5.x's in-memory layout,
# gate rows before up rows); `unstack_experts` writes them one per expert for the engines.
DEEPSEEK_STACKED_EXPERTS: Symbolic = {
    "mlp.experts.gate_up_proj": ("E", "2MI", "H"),
    "mlp.experts.down_proj": ("E", "H", "MI"),
}


def deepseek_dims(hf: Mapping) -> dict[str, int]:
    """Symbols of the DeepSeek tables, from the target's Hugging Face config.json."""
    n, qk = hf["num_attention_heads"], hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    return {
        "H": hf["hidden_size"],
        "2H": 2 * hf["hidden_size"],
        "V": hf["vocab_size"],
        "I": hf["intermediate_size"],
        "QR": hf.get("q_lora_rank") or 0,
        "KVR": hf["kv_lora_rank"],
        "KVR+R": hf["kv_lora_rank"] + hf["qk_rope_head_dim"],
        "NQK": n * qk,
        "NKV": n * (hf["qk_nope_head_dim"] + hf["v_head_dim"]),
        "NV": n * hf["v_head_dim"],
        "E": hf.get("n_routed_experts") or 0,
        "MI": hf.get("moe_intermediate_size") or 0,
        "2MI": 2 * (hf.get("moe_intermediate_size") or 0),
        "SI": (hf.get("moe_intermediate_size") or 0) * (hf.get("n_shared_experts") or 0),
    }


def deepseek_attention_symbolic(hf: Mapping) -> Symbolic:
    """A DeepSeek decoder layer's attention and norms."""
    return {**(DEEPSEEK_Q_LORA if hf.get("q_lora_rank") else DEEPSEEK_Q_FULL), **DEEPSEEK_KV_O}


def deepseek_dense_block(hf: Mapping) -> Symbolic:
    """A DeepSeek decoder layer with a dense MLP (a DeepSeek-kind head's layer)."""
    return {**deepseek_attention_symbolic(hf), **DEEPSEEK_DENSE_MLP}


def deepseek_moe_block(hf: Mapping) -> Symbolic:
    """A DeepSeek decoder layer with the target's MoE block, experts stacked (a native MoE head's layer)."""
    noaux = DEEPSEEK_NOAUX if hf.get("topk_method") == "noaux_tc" else {}
    return {**deepseek_attention_symbolic(hf), **DEEPSEEK_MOE, **noaux, **DEEPSEEK_STACKED_EXPERTS}


# Native head name → name under model.layers.{N}. The block's names pass through unchanged: a
# DeepSeek-kind head's `layer.*` tensors carry the DeepSeek layer's own names.
DEEPSEEK_RENAME = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "fc.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
    "embed_tokens.weight": "embed_tokens.weight",
    "lm_head.weight": "shared_head.head.weight",
}
