"""Multi-head latent attention (MLA): packed prefill, latent-cache decode with weight absorption, and
the interleaved-pair rotary it uses (YaRN magnitude included)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.attention import cache_slots, packed_causal_attention
from inference_ref.causal_lm import Fp32Frequencies, RMSNorm, front_rows, move_slots
from inference_ref.models.deepseek_v2.config import (
    LATENT_NORM_EPS,
    DeepseekV2Config,
    rope_inv_freq,
    rope_magnitude,
    softmax_scale,
)


class Rotary(Fp32Frequencies):
    """fp32 cos/sin [..., qk_rope_head_dim / 2] for given positions, the YaRN magnitude included."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.magnitude = rope_magnitude(cfg)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`dtype` (the activations') is not used: DeepSeek rotates in fp32 whatever they are."""
        freqs = positions.float()[..., None] * self.inv_freq
        return freqs.cos() * self.magnitude, freqs.sin() * self.magnitude


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [..., T, heads, d] by cos/sin [..., T, d/2], in fp32."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2).to(x.dtype)


class LatentAttention(nn.Module):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.cfg, self.n_heads, self.scale = cfg, cfg.num_attention_heads, softmax_scale(cfg)
        self.q_in = cfg.q_lora_rank or self.n_heads * cfg.qk_head_dim
        # One matmul for what reads x: the query (or its low-rank down-projection) | latent | k_rope.
        self.q_kv_a_proj = nn.Linear(
            cfg.hidden_size, self.q_in + cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False
        )
        if cfg.q_lora_rank:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, self.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.n_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def _project(self, x, cos, sin):
        """x [..., H] → q_nope [..., h, nope], rotated q_rope [..., h, rope], normed latent [..., r],
        rotated k_rope [..., rope]."""
        c = self.cfg
        q, latent, k_rope = self.q_kv_a_proj(x).split([self.q_in, c.kv_lora_rank, c.qk_rope_head_dim], -1)
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.unflatten(-1, (self.n_heads, c.qk_head_dim)).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], -1
        )
        k_rope = apply_rotary(k_rope.unsqueeze(-2), cos, sin).squeeze(-2)
        return q_nope, apply_rotary(q_rope, cos, sin), self.kv_a_layernorm(latent), k_rope

    def forward_packed(self, x, cos, sin, cu_seqlens, max_len):
        """x [T, H]. Prefill-sized work: up-project the latent to per-head keys and values and run
        ordinary attention, cheaper than attending in the 512-wide latent space for every head."""
        c = self.cfg
        q_nope, q_rope, latent, k_rope = self._project(x, cos, sin)
        kv = self.kv_b_proj(latent).unflatten(-1, (self.n_heads, -1))
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope.unsqueeze(-2).expand_as(q_rope)], -1)
        # The kernel scales by 1/sqrt(qk_head_dim) with no way to change it: YaRN's extra mscale²
        # goes into q. It also takes one head size for q, k and v (FlashAttention's varlen does):
        # v is zero-padded from v_head_dim to qk_head_dim and the padding sliced off the output.
        q = torch.cat([q_nope, q_rope], -1) * (self.scale * c.qk_head_dim**0.5)
        v = F.pad(v, (0, c.qk_head_dim - c.v_head_dim))
        o = packed_causal_attention(q, k, v, cu_seqlens, max_len)[..., : c.v_head_dim]
        return self.o_proj(o.flatten(-2))

    def forward_cached(self, x, cos, sin, cache, slots, mask):
        """x [B, S, H]; writes latent | k_rope at `slots` [B, S] of this layer's cache
        [B, max_len, r + rope], then attends to it without ever expanding it per head.

        Weight absorption (DeepSeek-V2 paper, vLLM and SGLang's decode path): kv_b_proj's key half
        W_uk [h, nope, r] moves onto the query, q_nope·(W_uk c) = (q_nope W_uk)·c, and its value
        half W_uv [h, v, r] onto the output, Σ p·(W_uv c) = W_uv (Σ p·c). Every head then attends
        to the same cached rows (one-KV-head attention of width r + rope), so a decode step reads
        576 numbers per cached token instead of 16 heads × 320 up-projected ones."""
        c = self.cfg
        q_nope, q_rope, latent, k_rope = self._project(x, cos, sin)
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        cache[rows, slots] = torch.cat([latent, k_rope], -1).to(cache.dtype)
        keys = cache[:, : mask.shape[-1]].unsqueeze(1)  # [B, 1, K, r + rope]
        w_uk, w_uv = self.kv_b_proj.weight.view(self.n_heads, -1, c.kv_lora_rank).split(
            [c.qk_nope_head_dim, c.v_head_dim], 1
        )
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope], -1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            keys[..., : c.kv_lora_rank],
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        o = torch.einsum("bhsr,hvr->bshv", o, w_uv)
        return self.o_proj(o.flatten(-2))


@dataclass
class LatentCache:
    """Static latent cache for a batch: row b holds `lengths[b]` committed entries.

    Per layer and token: the normed KV latent (kv_lora_rank) then the rotated k_rope
    (qk_rope_head_dim). Entries past a row's length are scratch, as in `causal_lm.KVCache`."""

    kv: torch.Tensor  # [layers, B, max_len, kv_lora_rank + qk_rope_head_dim]
    lengths: torch.Tensor  # [B] int64

    @classmethod
    def empty(
        cls, cfg: DeepseekV2Config, layers: int, batch: int, max_len: int, device, dtype
    ) -> LatentCache:
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        kv = torch.zeros(layers, batch, max_len, width, device=device, dtype=dtype)
        return cls(kv, torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def max_len(self) -> int:
        return self.kv.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor]:
        """Layer i's storage, as its cached forward takes it."""
        return (self.kv[i],)

    def shifted(self, n: int) -> LatentCache:
        """The same storage with every row `n` entries longer (see `causal_lm.KVCache.shifted`)."""
        return LatentCache(self.kv, self.lengths + n)

    def rows(self, index: torch.Tensor) -> LatentCache:
        """A cache of rows `index` only, moved to the front in place (see `causal_lm.KVCache.rows`)."""
        return LatentCache(front_rows(self.kv, index), self.lengths[index])

    def slots(self, new: int, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, new] the next `new` tokens take, and their mask (`attention.cache_slots`)."""
        return cache_slots(self.lengths, self.max_len, new, static)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row b's entries at slots src[b] copied to dst[b] ([B, n]), every layer (`move_slots`)."""
        move_slots(self.kv, src, dst)
