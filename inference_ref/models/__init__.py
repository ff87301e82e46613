"""The target kinds: one registry keyed by the `model_type` of a Hugging Face `config.json`.

Each kind is one module (or small package) under `inference_ref/models/` and one entry in `TARGET_KINDS`:
its config class, model class, weight loader, random weights, the tiny debug shape, and how a draft
head builds a layer of its kind. Outside it, a kind appears only where a format belongs to one kind:
GGUF files (Llama), the engine layouts (`mtp_train/serving/layouts.py`), the EAGLE-3 head (Llama
layers), and the training head's layer table (`mtp_train/heads/layers.py`).
Adding a kind: docs/design.md, "Adding a target kind".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from inference_ref.causal_lm import CausalLM, KVCache
from inference_ref.loading import EMBED, FINAL_NORM, LM_HEAD
from inference_ref.models import deepseek_v2, deepseek_v3, llama, qwen3, qwen3_moe

Config = (
    llama.LlamaConfig
    | qwen3.Qwen3Config
    | qwen3_moe.Qwen3MoeConfig
    | deepseek_v2.DeepseekV2Config
    | deepseek_v3.DeepseekV3Config
)
Cache = KVCache | deepseek_v2.LatentCache


class TargetKind(NamedTuple):
    """What makes a target of one kind, and a draft head's layer of that kind."""

    config: type
    """Has `model_type`, `from_hf(dict)`, `to_hf()`, `fingerprint()`."""
    model: type[CausalLM]
    load: Callable[..., CausalLM]
    """`(path, device, dtype)` → the model, from a Hugging Face directory."""
    random: Callable[..., CausalLM]
    """`(cfg, device, dtype, seed)` → a model with random weights (tests, benchmarks)."""
    hf_state_dict: Callable[[CausalLM], dict[str, torch.Tensor]]
    """A model's weights under the Hugging Face checkpoint's names."""
    head_layer: Callable[[Config, str], tuple[nn.Module, nn.Module, type]]
    """`(cfg, mlp)` → a serving head's decoder layer, rotary module and cache type."""
    fuse_head_layer: Callable[[dict, Config, str], dict]
    """`(tensors, cfg, mlp)`: a native head's `layer.*` tensors → the serving layer's names."""
    head_mlps: tuple[str, ...]
    """The MLPs a head's layer can have (`dense`, and `moe` where the target's layers have experts)."""
    tiny: dict
    """The debug shape: a few layers of 64 wide, every structural feature of the kind kept."""
    shared: tuple[str, ...] = (EMBED, FINAL_NORM, LM_HEAD)
    """The checkpoint's tensors a head shares: embeddings, final norm, lm_head."""
    fuse_layer: Callable[[dict, str, str], dict] | None = None
    """`(hf, prefix, new_prefix)`: one decoder layer's checkpoint tensors → the model's names. Kinds
    that have it are Llama-layered and shard over tensor parallelism (`inference_ref.tensor_parallel`)."""


TARGET_KINDS: dict[str, TargetKind] = {
    llama.LlamaConfig.model_type: TargetKind(
        config=llama.LlamaConfig,
        model=llama.LlamaModel,
        load=llama.load_llama,
        random=llama.random_llama,
        hf_state_dict=llama.hf_state_dict,
        head_layer=llama.head_layer,
        fuse_head_layer=llama.fuse_head_layer,
        head_mlps=("dense",),
        tiny=llama.TINY,
        fuse_layer=llama.fuse_layer,
    ),
    qwen3.Qwen3Config.model_type: TargetKind(
        config=qwen3.Qwen3Config,
        model=qwen3.Qwen3Model,
        load=qwen3.load_qwen3,
        random=qwen3.random_qwen3,
        hf_state_dict=qwen3.hf_state_dict,
        head_layer=qwen3.head_layer,
        fuse_head_layer=qwen3.fuse_head_layer,
        head_mlps=("dense",),
        tiny=qwen3.TINY,
        fuse_layer=llama.fuse_layer,
    ),
    qwen3_moe.Qwen3MoeConfig.model_type: TargetKind(
        config=qwen3_moe.Qwen3MoeConfig,
        model=qwen3_moe.Qwen3MoeModel,
        load=qwen3_moe.load_qwen3_moe,
        random=qwen3_moe.random_qwen3_moe,
        hf_state_dict=qwen3_moe.hf_state_dict,
        head_layer=qwen3_moe.head_layer,
        fuse_head_layer=qwen3_moe.fuse_head_layer,
        head_mlps=("dense",),
        tiny=qwen3_moe.TINY,
    ),
    deepseek_v2.DeepseekV2Config.model_type: TargetKind(
        config=deepseek_v2.DeepseekV2Config,
        model=deepseek_v2.DeepseekV2Model,
        load=deepseek_v2.load_deepseek_v2,
        random=deepseek_v2.random_deepseek_v2,
        hf_state_dict=deepseek_v2.hf_state_dict,
        head_layer=deepseek_v2.head_layer,
        fuse_head_layer=deepseek_v2.fuse_head_layer,
        head_mlps=("dense", "moe"),
        tiny=deepseek_v2.TINY,
    ),
    deepseek_v3.DeepseekV3Config.model_type: TargetKind(
        config=deepseek_v3.DeepseekV3Config,
        model=deepseek_v2.DeepseekV2Model,
        load=deepseek_v3.load_deepseek_v3,
        random=deepseek_v2.random_deepseek_v2,
        hf_state_dict=deepseek_v2.hf_state_dict,
        head_layer=deepseek_v2.head_layer,
        fuse_head_layer=deepseek_v2.fuse_head_layer,
        head_mlps=("dense", "moe"),
        tiny=deepseek_v3.TINY,
    ),
}


def kind_of(model_type: str | None, where: str = "config.json") -> TargetKind:
    """The registry entry for `model_type`, refusing one no kind handles with the list of those that are."""
    if model_type not in TARGET_KINDS:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported ({', '.join(TARGET_KINDS)})")
    return TARGET_KINDS[model_type]
