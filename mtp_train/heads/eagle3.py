"""The EAGLE-3 head for training (Llama-kind targets): architecture only.

    g = fc([a_1; …; a_n])                       the target's states entering the aux layers, 3H → H
    y = g + attn([input_layernorm(e); hidden_norm(g)])      e = embed(t_{i+1}); q/k/v read 2H
    y = y + mlp(post_attention_layernorm(y));  z = norm(y);  logits = lm_head_d(z)

A chained step reads its own y as g (no fc), as the EAGLE reference and the engines run it. With
`spec.layers` > 1, Llama layers over H follow the first at every step (vLLM's `llama_eagle3.py`:
layer i ≥ 1 reads the previous layer's output, its residual fused into input_layernorm); y is the
last one's output. What is trained: fc, the layers, the norms. What is frozen: the target's
embeddings, and the lm_head, whose rows for the draft vocabulary (`d2t`) are the draft's lm_head:
the draft then scores exactly the target's restricted distribution that EAGLE-3's loss trains
toward, the loss keeps its chunked form (one frozen matrix), and a 32k × H lm_head adds nothing to
the optimizer (docs/design.md).
"""

from __future__ import annotations

import torch
from torch import nn

from inference_ref.causal_lm import RMSNorm
from inference_ref.head_spec import HeadSpec, Symbolic
from mtp_train.head_attention import Segments
from mtp_train.heads.base import DraftHead
from mtp_train.heads.llama import HeadAttention, HeadMLP
from mtp_train.heads.mtp import HeadLayer
from mtp_train.layer_names import EAGLE3_BLOCK, EAGLE3_LATER_BLOCK, llama_dims


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer over x = [e; g] (2H): each half normalized, attention 2H → H, the
    residual stream is g (`norm_before_residual` false, as the reference and SGLang build it)."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = HeadAttention(cfg, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = HeadMLP(h, cfg.intermediate_size)

    def forward(self, x, positions, batch: Segments, kv: list):
        e, g = x.chunk(2, -1)
        y = g + self.self_attn(
            torch.cat([self.input_layernorm(e), self.hidden_norm(g)], -1), positions, batch, kv
        )
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(DraftHead):
    """EAGLE-3's layer on what every head shares (`DraftHead`: chained forward, loss interface,
    frozen buffers, draft vocabulary; fc and norm from `head_spec.Eagle3Math`)."""

    def build_layer(self, spec: HeadSpec) -> nn.Module:
        return Eagle3Layer(spec.target)

    def build_later_layers(self, spec: HeadSpec) -> list[nn.Module]:
        """Llama decoder layers over H whatever the target kind (the engines' draft layers are Llama's)."""
        return [
            HeadLayer(spec.target, input_norm=True, attention=HeadAttention) for _ in range(spec.layers - 1)
        ]

    @classmethod
    def native_block(cls, spec: HeadSpec) -> tuple[Symbolic, dict[str, int]]:
        return EAGLE3_BLOCK, llama_dims(spec.target)

    @classmethod
    def native_later_block(cls, spec: HeadSpec) -> Symbolic:
        return EAGLE3_LATER_BLOCK
