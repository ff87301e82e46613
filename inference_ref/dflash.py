"""The DFlash draft for serving: a block drafter. Its cache holds, per draft layer, the K/V of the
context, one entry per committed position made from the target's states there; each verify step
drafts a whole block in one forward.

    context entry m: c_m = hidden_norm(fc([a_1; …; a_n]_m)), K/V = k_norm(k_proj(c_m)) (rope at m), v_proj(c_m)
    block: [last, mask × k] at positions L … L + k (L = committed entries; `last` is the target's
        token at L), written at scratch slots L … L + k, every query seeing the context 0 … L − 1
        and the whole block (no causal mask inside it); the logits at L + j propose d_j

as vLLM 0.32 serves it (`v1/spec_decode/dflash.py` `DFlashProposer`: query tokens the bonus token
and k mask tokens, context K/V precomputed by `DFlashQwen3Model.precompute_and_store_context_kv`,
non-causal attention). The refill after a verify is the context of the committed positions, made
from the states that verify computed (no second target pass). It has no chained steps: trees and
SSD's extra step are not defined for it. The training module is `mtp_train.heads.dflash.DFlashHead`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.attention import Placement, cache_mask, key_length
from inference_ref.causal_lm import KVCache
from inference_ref.draft_base import Draft
from inference_ref.head_spec import SHARED, HeadSpec
from inference_ref.models.llama import DecoderLayer, Rotary, apply_rotary, fuse_layer
from inference_ref.models.qwen3 import Qwen3Attention
from inference_ref.target import Cache


class DFlashDecoderLayer(DecoderLayer):
    """Qwen3's decoder layer (fused q|k|v, q/k norms) that also writes context entries."""

    def __init__(self, cfg):
        super().__init__(cfg, Qwen3Attention)

    def write_context(self, c, cos, sin, k_cache, v_cache, slots) -> None:
        """K/V of context states c [B, S, H] at `slots` [B, S]: the k/v rows of qkv_proj, k_norm, rope."""
        a = self.self_attn
        q_size, kv_size = a.n_heads * a.head_dim, a.n_kv * a.head_dim
        k, v = F.linear(c, a.qkv_proj.weight[q_size:]).split([kv_size, kv_size], -1)
        k = apply_rotary(a.k_norm(k.unflatten(-1, (a.n_kv, a.head_dim))), cos, sin)
        rows = torch.arange(c.shape[0], device=c.device)[:, None]
        k_cache[rows, slots] = k.to(k_cache.dtype)
        v_cache[rows, slots] = v.unflatten(-1, (a.n_kv, a.head_dim)).to(v_cache.dtype)


class DFlashDraft(Draft):
    """`spec.layers` DFlash layers on what every draft shares (`Draft`: the shared tensors, logits
    over the target vocabulary); fc, hidden_norm and norm from `head_spec.DFlashMath`."""

    chains = False

    def layer_passes(self, k: int) -> int:
        """One block forward through its layers, whatever k (the refill writes context K/V only)."""
        return self.spec.layers

    def build_layer(self, spec: HeadSpec) -> tuple[nn.Module, nn.Module, type]:
        layers = nn.ModuleList(DFlashDecoderLayer(spec.target) for _ in range(spec.layers))
        return layers, Rotary(spec.target), KVCache

    def fuse(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each `layer.<i>.*` fused as a Llama layer's; fc and the norms as they are."""
        out = {n: t for n, t in tensors.items() if n not in SHARED and not n.startswith("layer.")}
        for i in range(self.spec.layers):
            out.update(fuse_layer(tensors, f"layer.{i}.", f"layer.{i}."))
        return out

    def new_cache(self, batch: int, max_len: int) -> Cache:
        w = self.fc.weight
        return self.cache_type.empty(self.spec.target, self.spec.layers, batch, max_len, w.device, w.dtype)

    @torch.inference_mode()
    def prefill(self, hidden, next_tokens, cache: Cache, static: bool = False) -> torch.Tensor:
        """Context entries for the target's widened states hidden [B, S, (1 + n)·H] at the cache's
        lengths (the prompt; after each verify, its positions). Does not commit. The next tokens
        are not read: the block brings its anchor. Returns the last layer's states as `y` (unused)."""
        slots = cache.lengths[:, None] + torch.arange(hidden.shape[1], device=hidden.device)
        c = self.spec.kind.math.context(self, hidden)
        cos, sin = self.rotary(slots, c.dtype)
        for i, layer in enumerate(self.layer):
            layer.write_context(c, cos, sin, *cache.layer(i), slots)
        return hidden[..., : self.spec.target.hidden_size]

    def run_block(self, tokens: torch.Tensor, cache: Cache, placement: Placement) -> torch.Tensor:
        """The block's tokens [B, S] through the layers where `placement` puts them → y [B, S, H]."""
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotary(placement.positions, x.dtype)
        for i, layer in enumerate(self.layer):
            x = layer.forward_cached(x, cos, sin, *cache.layer(i), placement.slots, placement.mask)
        return x

    def block_placement(self, cache: Cache, size: int, static: bool) -> Placement:
        """A block of `size` tokens at slots and positions L … L + size − 1, each query seeing the
        context and the whole block: keys < L + size, not a causal mask."""
        slots = cache.lengths[:, None] + torch.arange(size, device=cache.lengths.device)
        keys = cache.max_len if static else key_length(int(slots.max()) + 1, cache.max_len)
        mask = cache_mask(cache.lengths + size - 1, 1, keys).expand(-1, -1, size, -1)
        return Placement(slots, slots, mask)

    @torch.inference_mode()
    def propose(
        self, y, last, cache, k, temperature, generator, static=False, saguaro_shape=None, score_after=False
    ):
        """k draft tokens [B, k] from one block [last, mask × k]: greedy its argmaxes, sampled a draw
        from each position's distribution (each d_j from q_j, which no other draft token changes:
        rejection sampling keeps the target's distribution with any such q). Returns the tokens,
        q [B, k, V] (None when greedy) and the logits [B, k, V]."""
        if score_after:
            raise ValueError("SSD's outcome prediction needs one more chained step; a dflash block has none")
        mask = last.new_full((last.shape[0], k), self.spec.mask_token_id)
        tokens = torch.cat([last[:, None], mask], 1)
        logits = self.logits(self.run_block(tokens, cache, self.block_placement(cache, k + 1, static))[:, 1:])
        return self.drafted(logits, temperature, generator, saguaro_shape)

    @torch.inference_mode()
    def teacher_forced_logits(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The first mask's logits [S, V] of the block anchored at every position of one text
        (hidden [1, S, ·], next_tokens [1, S]: t_{i+1} at i), each block the trained `block_size`
        tokens seeing the context ≤ i: all S blocks in one forward, placed after the context as a
        tree's nodes are (block i at scratch slots S + i·B …, rope positions i + 1 …)."""
        n, size = hidden.shape[1], self.spec.block_size
        cache = self.new_cache(1, n + n * size)
        self.prefill(hidden, next_tokens, cache)
        device = hidden.device
        block = torch.arange(size, device=device)
        base = torch.arange(n, device=device)
        slots = (n + base[:, None] * size + block).reshape(1, -1)
        positions = (base[:, None] + 1 + block).reshape(1, -1)
        keys = torch.arange(cache.max_len, device=device)
        owner = (keys - n).div(size, rounding_mode="floor")  # the block a scratch key belongs to
        query_block = base.repeat_interleave(size)
        sees = torch.where(
            keys[None] < n, keys[None] <= query_block[:, None], owner[None] == query_block[:, None]
        )
        tokens = torch.full((1, n, size), self.spec.mask_token_id, device=device)
        tokens[0, :, 0] = next_tokens[0]
        y = self.run_block(tokens.reshape(1, -1), cache, Placement(slots, positions, sees[None, None]))
        return self.logits(y.reshape(n, size, -1)[:, 1])
