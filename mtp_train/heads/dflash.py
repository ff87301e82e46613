"""The DFlash head for training: architecture only.

    c = hidden_norm(fc([a_1; …; a_n]))          the context, from the target's states at position m ≤ i
    rows r = 0 … B−1 at rope position i+1+r:    x_0 = embed(t_{i+1}) (the anchor), x_r = embed(mask)
    each layer: keys and values = [k/v(c_0 … c_i); k/v(x_0 … x_{B−1})], queries the block's rows
    y_r = layers(x_r);  z_r = norm(y_r);  the logits of row r ≥ 1 predict t_{i+1+r}

Every position i of a packed batch anchors a block (the references sample up to 512 anchors per
sequence; all of them costs B rows per position and wastes none of the data). Row r ≥ 1 of the
block at i is trained exactly as a chained head's step r at i is (`batching.align_sample`): toward
the target's distribution softmax(L_{i+r}), where t_{i+r+1} is supervised. So the batch, the loss
and its per-step metrics are the chained kinds', with `steps` = B − 1 and DFlash's position weights.
The attention is `head_attention`'s: causal over the context keys, plus one "diagonal" per block row
(the block's rows at the same i), which is the block's bidirectional part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.causal_lm import RMSNorm
from inference_ref.head_spec import HeadSpec, Symbolic
from inference_ref.models.llama import apply_rotary
from mtp_train.head_attention import Segments, head_attention
from mtp_train.heads.base import DraftHead
from mtp_train.heads.llama import HeadMLP
from mtp_train.heads.qwen3 import Qwen3HeadAttention
from mtp_train.layer_names import DFLASH_LAYER, llama_dims


class DFlashAttention(Qwen3HeadAttention):
    """Qwen3's attention whose keys are the context's and the whole block's."""

    def keys(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim)))
        return apply_rotary(k, cos, sin), self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))

    def block(self, rows: list[torch.Tensor], context: torch.Tensor, positions, batch: Segments):
        """rows: the block's B normalized inputs [T, H]; context c [T, H] (not normalized again:
        vLLM projects hidden_norm's output straight to K/V) → B outputs [T, H]."""
        ctx_rope = self.rotary(positions, context.dtype)
        ropes = [self.rotary(positions + 1 + r, x.dtype) for r, x in enumerate(rows)]
        kv = [self.keys(context, *ctx_rope)] + [self.keys(x, *rope) for x, rope in zip(rows, ropes)]
        out = []
        for x, (cos, sin) in zip(rows, ropes):
            q = apply_rotary(
                self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))), cos, sin
            )
            out.append(self.o_proj(head_attention(q, kv, batch).flatten(-2)))
        return out


class DFlashLayer(nn.Module):
    """vLLM's `DFlashQwen3DecoderLayer`: pre-norm residual attention and SwiGLU MLP."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = HeadMLP(h, cfg.intermediate_size)

    def forward(self, rows, context, positions, batch: Segments) -> list[torch.Tensor]:
        attended = self.self_attn.block([self.input_layernorm(x) for x in rows], context, positions, batch)
        rows = [x + a for x, a in zip(rows, attended)]
        return [x + self.mlp(self.post_attention_layernorm(x)) for x in rows]


class DFlashHead(DraftHead):
    """fc, hidden_norm and norm from `head_spec.DFlashMath`; `spec.layers` DFlash layers as `layer.<i>`."""

    def build_layer(self, spec: HeadSpec) -> nn.Module:
        return nn.ModuleList(DFlashLayer(spec.target) for _ in range(spec.layers))

    @classmethod
    def native_block(cls, spec: HeadSpec) -> tuple[Symbolic, dict[str, int]]:
        names = {f"{i}.{n}": s for i in range(spec.layers) for n, s in DFLASH_LAYER.items()}
        return names, {**llama_dims(spec.target), "D": spec.target.head_dim}

    def forward(self, hidden, token_ids, positions, batch, steps: int = 1) -> torch.Tensor:
        """The block anchored after every packed position i: hidden [T, (1 + n)·H] the target's
        widened states, token_ids[0] [T] the anchors t_{i+1}. Returns y [steps, T, H] of block rows
        1 … steps (≤ block_size − 1): row r predicts t_{i+1+r}, as a chained head's step r does."""
        spec = self.spec
        if not 1 <= steps < spec.block_size:
            raise ValueError(
                f"a block of {spec.block_size} tokens trains 1 … {spec.block_size - 1} rows, not {steps}"
            )
        context = spec.kind.math.context(self, hidden)
        anchor = F.embedding(token_ids[0], self.embed_weight).to(context.dtype)
        mask = self.embed_weight[spec.mask_token_id].to(context.dtype).expand_as(anchor)
        rows = [anchor] + [mask] * (spec.block_size - 1)
        for layer in self.layer:
            rows = layer(rows, context, positions, batch)
        return torch.stack(rows[1 : 1 + steps])
