"""A head's decoder layer on a Qwen3-kind target, for training: the Llama head layer with the
target's per-head q/k RMSNorms before rotary, and the layer's native names and shapes."""

from __future__ import annotations

from inference_ref.causal_lm import RMSNorm
from inference_ref.models.llama import apply_rotary
from inference_ref.models.qwen3 import Qwen3Config
from mtp_train.head_attention import Segments, head_attention
from mtp_train.heads.llama import HeadAttention
from mtp_train.layer_names import LLAMA_BLOCK, Symbolic, llama_dims

QK_NORMS: Symbolic = {"self_attn.q_norm.weight": ("D",), "self_attn.k_norm.weight": ("D",)}


class Qwen3HeadAttention(HeadAttention):
    def __init__(self, cfg: Qwen3Config, in_features: int | None = None):
        super().__init__(cfg, in_features)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, batch: Segments, kv: list):
        """As `HeadAttention.forward`, with q and k normalized per head before rotary."""
        cos, sin = self.rotary(positions, x.dtype)
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim)))
        kv.append((apply_rotary(k, cos, sin), self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))))
        return self.o_proj(head_attention(apply_rotary(q, cos, sin), kv, batch).flatten(-2))


def native_block(cfg: Qwen3Config, mlp: str) -> tuple[Symbolic, dict[str, int]]:
    """The Llama layer's names plus the q/k norms, and shape symbols."""
    return {**LLAMA_BLOCK, **QK_NORMS}, {**llama_dims(cfg), "D": cfg.head_dim}
