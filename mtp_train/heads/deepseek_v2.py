"""A head's decoder layer on a DeepSeek-V2-kind target, for training: MLA over packed chained steps,
the target's MoE block (optional), and the layer's native names and shapes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.causal_lm import RMSNorm
from inference_ref.loading import read_tensors, safetensors_files
from inference_ref.models import deepseek_v2 as ds
from mtp_train.head_attention import Segments, head_attention
from mtp_train.heads.llama import HeadMLP
from mtp_train.layer_names import (
    DEEPSEEK_RENAME,
    Symbolic,
    deepseek_dense_block,
    deepseek_dims,
    deepseek_moe_block,
)


class LatentHeadAttention(nn.Module):
    """MLA as DeepSeek-V2 runs it on a prefill: the latent up-projected to per-head keys and values
    (the serving draft attends in the latent space instead, through its latent cache)."""

    def __init__(self, cfg: ds.DeepseekV2Config):
        super().__init__()
        self.cfg, n, h = cfg, cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, ds.LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, ds.LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=False)
        self.rotary = ds.Rotary(cfg)
        # head_attention scales scores by 1/sqrt(q's width): YaRN's mscale² goes into q instead.
        self.q_scale = ds.softmax_scale(cfg) * cfg.qk_head_dim**0.5

    def forward(self, x, positions, batch: Segments, kv: list) -> torch.Tensor:
        """As `HeadAttention.forward`. Keys are [nope | rope] (the rope part shared by all heads);
        values are zero-padded to the key width, as the packed kernels take one head size."""
        c, n = self.cfg, self.cfg.num_attention_heads
        cos, sin = self.rotary(positions)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.unflatten(-1, (n, c.qk_head_dim)).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], -1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv_b = self.kv_b_proj(self.kv_a_layernorm(latent)).unflatten(-1, (n, -1))
        k_nope, v = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k_rope = ds.apply_rotary(k_rope.unsqueeze(-2), cos, sin).expand(-1, n, -1)
        q = torch.cat([q_nope, ds.apply_rotary(q_rope, cos, sin)], -1) * self.q_scale
        kv.append((torch.cat([k_nope, k_rope], -1), F.pad(v, (0, c.qk_head_dim - c.v_head_dim))))
        o = head_attention(q, kv, batch)[..., : c.v_head_dim]
        return self.o_proj(o.flatten(-2))


class HeadMoE(nn.Module):
    """The target's MoE block, trainable: router `gate` [E, H] (softmax, greedy or group-limited
    top-k, × routed_scaling_factor, as the target routes), routed experts stacked as gate|up
    [E, 2I, H] and down [E, H, I], and the shared experts as one MLP n_shared × I wide.

    Router and experts are the serving modules themselves, so training cannot route differently
    from serving. Both are differentiable: the routing weights are softmax scores gathered at the
    top-k (the router learns through them), and the tokens, sorted by expert, go through torch's
    grouped matmul, which has a backward (or through its per-expert fallback, which has one too)."""

    def __init__(self, cfg: ds.DeepseekV2Config):
        super().__init__()
        self.gate = ds.Router(cfg)  # the checkpoint's name for the router
        self.experts = ds.Experts(cfg)
        self.shared_experts = HeadMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x):
        """x [T, H] (packed tokens)."""
        return self.experts(x, *self.gate(x)) + self.shared_experts(x)


def native_block(cfg: ds.DeepseekV2Config, mlp: str) -> tuple[Symbolic, dict[str, int]]:
    """The layer's names (under `layer.`, without the input_layernorm only a restored head has)
    and shape symbols, an MoE head's experts stacked."""
    hf = cfg.to_hf()
    full = deepseek_moe_block(hf) if mlp == "moe" else deepseek_dense_block(hf)
    return {n: s for n, s in full.items() if n != "input_layernorm.weight"}, deepseek_dims(hf)


def shipped_mtp_state(target_dir, cfg: ds.DeepseekV2Config, mlp: str) -> dict[str, torch.Tensor]:
    """The MTP layer a DeepSeek-V3 checkpoint ships (`model.layers.{num_hidden_layers}.*`: enorm,
    hnorm, eh_proj, shared_head.norm and a decoder layer with the target's MoE) under the native
    head's names, experts stacked: a head's starting point instead of random weights."""
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n}."
    names = [k for k in safetensors_files(Path(target_dir)) if k.startswith(prefix)]
    if not names:
        raise ValueError(
            f"{target_dir}: the checkpoint ships no MTP layer (no {prefix}* tensors): unset model.init_from_target_mtp"
        )
    if mlp != "moe":
        raise ValueError(
            "model.init_from_target_mtp: the shipped MTP layer has the target's MoE block: set model.head_mlp=moe"
        )
    shipped = {k[len(prefix) :]: v for k, v in read_tensors(Path(target_dir), names).items()}
    native = {engine: name for name, engine in DEEPSEEK_RENAME.items()}
    out = {}
    for name, t in shipped.items():
        if name in ("embed_tokens.weight", "shared_head.head.weight"):
            continue  # the target's own, shared
        if name.startswith("mlp.experts."):
            continue  # stacked below
        out[native.get(name, f"layer.{name}")] = t
    stacked = ds.fuse_experts({f"{prefix}{k}": v for k, v in shipped.items()}, cfg, f"{prefix}mlp.experts.")
    out.update({f"layer.mlp.experts.{k}": v for k, v in stacked.items()})
    return out
