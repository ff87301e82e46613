"""A target of any registered kind (`inference_ref.models.KINDS`), chosen by its `config.json`'s
`model_type`: reading its config, loading it, and reading the tensors a head shares.

Every kind's model is a `causal_lm.CausalLM` (`forward_packed`, `new_cache`, `forward_cached`,
`logits`; embeddings, final norm and lm_head under the same attribute names), so precompute,
generation, the speculative loop and validation run any of them unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inference_ref.causal_lm import CausalLM
from inference_ref.loading import EMBED, LM_HEAD, read_tensors
from inference_ref.models import KINDS, Cache, kind_of
from inference_ref.models import Config as TargetConfig
from inference_ref.models.llama import load_llama

TargetModel = CausalLM
"""What the pipeline uses of a target: the skeleton every kind shares."""

__all__ = [
    "Cache",
    "KINDS",
    "TargetConfig",
    "TargetModel",
    "read_target_config",
    "load_target",
    "frozen_target_tensors",
]


def read_target_config(path: str | Path) -> TargetConfig:
    """The config of the checkpoint directory at `path`, of its own kind."""
    file = Path(path) / "config.json"
    hf = json.loads(file.read_text())
    return kind_of(hf.get("model_type"), str(file)).config.from_hf(hf)


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
    """The tensors a head shares with its target (embeddings, final norm, lm_head; the embeddings
    again when tied), read by name only."""
    cfg = read_target_config(model_dir)
    names = [n for n in KINDS[cfg.model_type].shared if not (cfg.tie_word_embeddings and n == LM_HEAD)]
    out = read_tensors(model_dir, names)
    out.setdefault(LM_HEAD, out[EMBED])
    return out
