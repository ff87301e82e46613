"""Reading checkpoints: safetensors tensors by name (single file or sharded), placing and random weights.

Never unpickles: safetensors only here (GGUF files are read by `inference_ref.gguf`). Tensors are
read by name, so callers that need only the embeddings, final norm and lm_head read only those.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        root = model_dir.resolve()
        outside = sorted({f for f in weight_map.values() if root not in (model_dir / f).resolve().parents})
        if outside:  # weights from elsewhere would also escape the target's fingerprint
            raise ValueError(f"{index}: shard files outside the target directory: {outside}")
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors (pickled .bin checkpoints are not loaded)")
    out = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def read_tensors(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors from a checkpoint directory."""
    where = safetensors_files(Path(model_dir))
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(f"{model_dir}: tensors not in checkpoint: {missing}")
    out = {}
    for name in names:
        with safe_open(where[name], "pt") as f:
            out[name] = f.get_tensor(name)
        scale = name + "_scale_inv"  # an FP8 weight stored with 128×128 block scales (DeepSeek-V3)
        if out[name].dtype == torch.float8_e4m3fn and scale in where:
            from inference_ref.quantization import dequantize_blocks

            with safe_open(where[scale], "pt") as f:
                out[name] = dequantize_blocks(out[name], f.get_tensor(scale)).to(torch.bfloat16)
    return out


def is_scale(name: str) -> bool:
    """A block-scale companion of an FP8 weight (read with its weight, never on its own)."""
    return name.endswith("weight_scale_inv")


def init_random(model: torch.nn.Module) -> None:
    """Random weights in place: norms near 1, everything else N(0, 0.02) (any target kind)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
        else:
            torch.nn.init.normal_(p, std=0.02)


def placed(state: dict[str, torch.Tensor], device, dtype) -> dict[str, torch.Tensor]:
    """`state` on `device` in `dtype`, except a MoE router, which stays fp32 whatever the model's
    dtype, as transformers keeps it (a bf16 gate flips near-tied expert choices), and integer
    tensors (an EAGLE-3 head's `d2t`), which keep theirs."""

    def dtype_of(name: str, t: torch.Tensor) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        return torch.float32 if ".router." in f".{name}" else dtype  # weight and V3's score bias

    return {k: v.to(device, dtype_of(k, v)) for k, v in state.items()}
