"""The EAGLE-3 draft head for serving (Llama-kind targets): `draft_base.Draft`'s cache, prefill/refill
and chained steps, with EAGLE-3's fc over the target's auxiliary states, its 2H-input layer and a draft
vocabulary.

    g = fc([a_1; …; a_n]) (from the target: the states the verify forward captured) or y (chained)
    y = g + attn([input_layernorm(e); hidden_norm(g)]);  y += mlp(post_attention_layernorm(y))
    logits over the target vocabulary: lm_head_d(norm(y)) at the draft ids, −inf elsewhere

The auxiliary states come from the target's own forward (prefill, then every verify), widened by
`capture` (`causal_lm.widened`): no extra target pass. The training module is
`mtp_train.heads.eagle3.Eagle3Head`; the math they share is `inference_ref.head_spec`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_ref.causal_lm import KVCache, RMSNorm
from inference_ref.draft_base import Draft, fuse_head_state
from inference_ref.head_spec import HeadSpec
from inference_ref.models.llama import MLP, Attention, DecoderLayer, Rotary, fuse_layer


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's layer over x = [e; g] (2H): q/k/v read [input_layernorm(e); hidden_norm(g)], the
    residual stream is g; Llama attention (fused q|k|v) and MLP otherwise."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = Attention(cfg)
        self.self_attn.qkv_proj = nn.Linear(2 * h, self.self_attn.qkv_proj.out_features, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def forward_cached(self, x, cos, sin, k_cache, v_cache, slots, mask):
        e, g = x.chunk(2, -1)
        a = torch.cat([self.input_layernorm(e), self.hidden_norm(g)], -1)
        y = self.self_attn.forward_cached(a, cos, sin, k_cache, v_cache, slots, mask, residual=g)
        return self.mlp(y, residual=y, norm=self.post_attention_layernorm)


class Eagle3Draft(Draft):
    """EAGLE-3's 2H-input layer on what every draft shares (`Draft`); fc and norm from
    `head_spec.Eagle3Math`, d2t always held (the engines' files carry it)."""

    def build_layer(self, spec: HeadSpec) -> tuple[nn.Module, nn.Module, type]:
        return Eagle3DecoderLayer(spec.target), Rotary(spec.target), KVCache

    def build_later_layers(self, spec: HeadSpec) -> list[nn.Module]:
        """Llama layers over H after the first (vLLM llama_eagle3.py, layer_idx ≥ 1)."""
        return [DecoderLayer(spec.target) for _ in range(spec.layers - 1)]

    def fuse(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layers' q|k|v and gate|up fused as the Llama target's; hidden_norm and d2t as they are."""
        later = [f"later_layers.{i}." for i in range(self.spec.layers - 1)]
        first = {n: t for n, t in tensors.items() if not n.startswith("later_layers.")}
        out = {
            **fuse_head_state(first, self.spec),
            "layer.hidden_norm.weight": tensors["layer.hidden_norm.weight"],
        }
        for prefix in later:
            out.update(fuse_layer(tensors, prefix, prefix))
        return out
