"""A head's decoder layer on a Llama-kind target, for training: attention over packed chained steps,
the SwiGLU MLP, and the layer's native names and shapes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.models.llama import LlamaConfig, Rotary, apply_rotary
from mtp_train.head_attention import Segments, head_attention
from mtp_train.layer_names import LLAMA_BLOCK, Symbolic, llama_dims


class HeadAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_features: int | None = None):
        """`in_features`: the width q/k/v read (the hidden size; 2H for EAGLE-3's layer)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        width = in_features or cfg.hidden_size
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = Rotary(cfg)

    def forward(self, x, positions, batch: Segments, kv: list) -> torch.Tensor:
        """x [T, H] of one chained step at rope `positions` [T]; `kv` holds the (k, v) of earlier
        steps and gets this one's."""
        cos, sin = self.rotary(positions, x.dtype)
        q = apply_rotary(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim)), cos, sin)
        kv.append((k, self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))))
        return self.o_proj(head_attention(q, kv, batch).flatten(-2))


class HeadMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def native_block(cfg: LlamaConfig, mlp: str) -> tuple[Symbolic, dict[str, int]]:
    """The layer's names (under `layer.`, without the input_layernorm only a restored head has)
    and shape symbols."""
    return LLAMA_BLOCK, llama_dims(cfg)
