"""GGUF (llama.cpp) Llama checkpoints: de-quantize to float and map to Hugging Face names.

`convert_gguf` writes a plain Hugging Face directory (config.json, model.safetensors, tokenizer
with its chat template) once, so that every later stage reads one kind of checkpoint; `load_gguf`
builds the target from the file directly. This module imports the Llama model, never the reverse.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from inference_ref.models.llama import LlamaConfig, LlamaModel, build_model, fuse_hf_state_dict

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not a Llama-family model")
    names = {t.name for t in reader.tensors}
    heads = _field(reader, "llama.attention.head_count")
    hidden = _field(reader, "llama.embedding_length")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=_field(reader, "llama.vocab_size", int(embed.shape[1])),
        hidden_size=hidden,
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_field(reader, "llama.attention.head_count_kv", heads),
        head_dim=_field(reader, "llama.rope.dimension_count", hidden // heads),
        rms_norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_theta=_field(reader, "llama.rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=_field(reader, "llama.context_length", 8192),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(_field(reader, "tokenizer.ggml.eos_token_id"),),
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rope kernel; undo that to HF's half-split layout.
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    _, layer, kind = stem.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """De-quantized float32 tensors under Hugging Face Llama names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg.num_key_value_heads)
        out[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return cfg, out


def load_gguf(path: str | Path, device="cpu", dtype=torch.float32) -> LlamaModel:
    """A Llama target straight from a `.gguf` file (the converted directory is what stages load)."""
    cfg, hf = read_gguf(path)
    return build_model(cfg, fuse_hf_state_dict(hf, cfg), device, dtype)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory (fp32 safetensors, tokenizer, chat template) from a GGUF."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    # Written under a private name and renamed: processes converting at once (several ranks)
    # never see, or clobber, a half-written directory.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg, tensors = read_gguf(gguf_path)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first: its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
