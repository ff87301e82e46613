"""A target of any supported kind, chosen by its `config.json`'s `model_type`.

The kind is that `model_type`: each config class carries it as `model_type`, and `KINDS` below
is the one table from a kind to what makes a target of it. Code elsewhere asks
`cfg.model_type == ...` or looks a kind up in `KINDS`.

Every kind has a config with `from_hf` / `to_hf` / `fingerprint` and a model built on
`llama.CausalLM` (`forward_packed`, `new_cache`, `forward_cached`, `logits`; embeddings, final
norm and lm_head under the same attribute names), so precompute, generation, the speculative loop
and validation run any of them unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from inference_ref.config import LlamaConfig
from inference_ref.deepseek_v2 import DeepseekV2Config, LatentCache, load_deepseek_v2
from inference_ref.llama import CausalLM, KVCache
from inference_ref.loading import EMBED, FINAL_NORM, LM_HEAD, load_llama, read_tensors

TargetConfig = LlamaConfig | DeepseekV2Config
Cache = KVCache | LatentCache


TargetModel = CausalLM
"""What the pipeline uses of a target: the skeleton `LlamaModel` and `DeepseekV2Model` share."""


class Kind(NamedTuple):
    """What makes a target of one kind."""

    config: type[TargetConfig]
    load: Callable[..., TargetModel]
    """`(path, device, dtype)` → the model, from a Hugging Face directory."""


KINDS: dict[str, Kind] = {
    LlamaConfig.model_type: Kind(LlamaConfig, load_llama),
    DeepseekV2Config.model_type: Kind(DeepseekV2Config, load_deepseek_v2),
}


def target_kind(hf: dict) -> str:
    """The kind of a Hugging Face config dict, refusing the ones this project does not run."""
    kind = hf.get("model_type")
    if kind not in KINDS:
        raise ValueError(f"config.json: model_type {kind!r} is not supported ({', '.join(KINDS)})")
    return kind


def config_from_hf(hf: dict) -> TargetConfig:
    return KINDS[target_kind(hf)].config.from_hf(hf)


def read_target_config(path: str | Path) -> TargetConfig:
    """The config of the checkpoint directory at `path`, of its own kind."""
    return config_from_hf(json.loads((Path(path) / "config.json").read_text()))


def load_target(path: str | Path, device="cpu", dtype=torch.float32, compile: bool = False) -> TargetModel:
    """Load a target from a Hugging Face directory (any kind) or a Llama `.gguf` file. `compile`
    fuses its layers (`CausalLM.compile_layers`) where that is measured: on CUDA, for a kind that
    is `compilable`; elsewhere it is ignored."""
    path = Path(path)
    if path.suffix == ".gguf":
        model = load_llama(path, device, dtype)
    else:
        model = KINDS[read_target_config(path).model_type].load(path, device, dtype)
    if compile and torch.device(device).type == "cuda" and model.compilable:
        model.compile_layers()
    return model


def frozen_target_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Embeddings, final norm and lm_head (the embeddings again when tied): what a head shares."""
    cfg = read_target_config(model_dir)
    names = [EMBED, FINAL_NORM] + ([] if cfg.tie_word_embeddings else [LM_HEAD])
    out = read_tensors(model_dir, names)
    out.setdefault(LM_HEAD, out[EMBED])
    return out
