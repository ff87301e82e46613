"""The EAGLE-3 draft head for serving (Llama-kind targets): `MTPDraft`'s cache, prefill/refill and
chained steps, with EAGLE-3's fc over the target's auxiliary states, its 2H-input layer and a draft
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
from inference_ref.draft import MTPDraft, fuse_head_state
from inference_ref.head_spec import HeadSpec, draft_ids, output_state
from inference_ref.models.llama import MLP, Attention, Rotary
from inference_ref.target import TargetModel


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
        y = g + self.self_attn.forward_cached(a, cos, sin, k_cache, v_cache, slots, mask)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Draft(MTPDraft):
    def __init__(self, spec: HeadSpec):
        nn.Module.__init__(self)
        self.spec, t = spec, spec.target
        self.fc = nn.Linear(len(spec.aux_layers) * t.hidden_size, t.hidden_size, bias=False)
        self.layer, self.rotary, self.cache_type = Eagle3DecoderLayer(t), Rotary(t), KVCache
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(spec.vocab, dtype=torch.long))

    @property
    def capture(self) -> tuple[int, ...]:
        return self.spec.aux_layers

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target id of each draft-vocabulary row (engines store the offsets, `d2t`)."""
        return draft_ids(self.d2t)

    def fuse(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's q|k|v and gate|up fused as the Llama target's; hidden_norm and d2t as they are."""
        return {
            **fuse_head_state(tensors, self.spec),
            "layer.hidden_norm.weight": tensors["layer.hidden_norm.weight"],
        }

    def share(self, target: TargetModel, tensors: dict[str, torch.Tensor]) -> None:
        """The target's embeddings and final norm; the lm_head is the target's rows of the draft
        vocabulary (or the head file's own `lm_head.weight`, [Vd, H])."""
        weight = target.embed_tokens.weight
        self.embed_tokens, self.target_norm = target.embed_tokens, target.norm
        if "embed_tokens.weight" in tensors:
            self.embed_tokens = nn.Embedding.from_pretrained(
                tensors["embed_tokens.weight"].to(weight.device, weight.dtype)
            )
        rows = tensors.get("lm_head.weight")
        if rows is None:
            full = target.lm_head.weight
            full = (
                full.full_tensor() if hasattr(full, "full_tensor") else full
            )  # vocab-parallel: gathered once
            rows = full[self.draft_ids]
        else:
            rows = rows.to(weight.device, weight.dtype)
        self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)

    @torch.inference_mode()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the target vocabulary: the draft vocabulary's scored, the rest −inf (so
        that greedy and rejection sampling run unchanged, as vLLM maps EAGLE-3 logits)."""
        scores = self.lm_head(output_state(self, y)).float()
        vocab = self.spec.target.vocab_size
        if scores.shape[-1] == vocab:
            return scores
        out = scores.new_full((*scores.shape[:-1], vocab), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, scores)


DRAFT = Eagle3Draft  # what this module serves, for `HEAD_KINDS[...].serving`
