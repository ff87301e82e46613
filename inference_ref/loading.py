"""Load a Llama-family target from a local Hugging Face directory or a GGUF file.

Never unpickles: safetensors (single file or sharded with an index) and GGUF only. Tensors are
read by name, so callers that need only the embeddings, final norm and lm_head read only those.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from inference_ref.config import LlamaConfig, read_config
from inference_ref.llama import LlamaModel, Rotary

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
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
    return out


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names → this model's names, fusing q|k|v and gate|up."""
    out = {
        "embed_tokens.weight": hf[EMBED],
        "norm.weight": hf[FINAL_NORM],
        "lm_head.weight": hf[EMBED] if cfg.tie_word_embeddings else hf[LM_HEAD],
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        attn = [hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        out[q + "self_attn.qkv_proj.weight"] = torch.cat(attn, 0)
        out[q + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        gate_up = [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        out[q + "mlp.gate_up_proj.weight"] = torch.cat(gate_up, 0)
        out[q + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        out[q + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
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
        gate, up = sd[q + "mlp.gate_up_proj.weight"].chunk(2)
        out.update(
            {
                p + "self_attn.q_proj.weight": wq.contiguous(),
                p + "self_attn.k_proj.weight": wk.contiguous(),
                p + "self_attn.v_proj.weight": wv.contiguous(),
                p + "self_attn.o_proj.weight": sd[q + "self_attn.o_proj.weight"],
                p + "mlp.gate_proj.weight": gate.contiguous(),
                p + "mlp.up_proj.weight": up.contiguous(),
                p + "mlp.down_proj.weight": sd[q + "mlp.down_proj.weight"],
                p + "input_layernorm.weight": sd[q + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": sd[q + "post_attention_layernorm.weight"],
            }
        )
    return out


def build_model(
    cfg: LlamaConfig, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32
) -> LlamaModel:
    """Assemble a model from a fused state dict without allocating random weights first."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg)  # its frequencies stay fp32 through the cast below
    model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


def load_llama(path: str | Path, device="cpu", dtype=torch.float32) -> LlamaModel:
    """Load a target from a Hugging Face directory or a `.gguf` file."""
    path = Path(path)
    if path.suffix == ".gguf":
        from inference_ref.gguf import read_gguf

        cfg, hf = read_gguf(path)
    else:
        cfg = read_config(path)
        where = safetensors_files(path)
        hf = read_tensors(path, [n for n in where if not n.endswith("rotary_emb.inv_freq")])
    return build_model(cfg, fuse_hf_state_dict(hf, cfg), device, dtype)


def init_random(model: torch.nn.Module) -> None:
    """Random weights in place: norms near 1, everything else N(0, 0.02) (any target kind)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
        else:
            torch.nn.init.normal_(p, std=0.02)


def random_llama(cfg: LlamaConfig, device="cpu", dtype=torch.float32, seed: int = 0) -> LlamaModel:
    """Random weights at a given shape (benchmarks, tiny test targets)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(cfg)
    init_random(model)
    model.to(dtype=dtype)
    return model.eval().requires_grad_(False)  # inference only: outputs never need autograd
