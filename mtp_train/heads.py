"""Draft heads for training: architecture only (no optimizer, launcher or logging here).

rmsnorm-restored (default):
    e = enorm(embed(t_{i+1}));  g = hnorm(h_i);  x = fc([e; g])
    y = layer(x);  z = norm(y);  logits = lm_head(z)          (y feeds chained steps)
eagle1 (ablation, the EAGLE paper's head):
    f = final_norm(h);  x = fc([embed(t_{i+1}); f_i]) with bias
    y = layer(x) without input_layernorm;  z = y;  logits = lm_head(y)

`layer` is one decoder layer of the target's kind: Llama attention, or for a DeepSeek-V2 target
multi-head latent attention (MLA) with the target's dimensions and by default a dense SwiGLU MLP of
the target's `intermediate_size` (the width of its dense layers), under the DeepSeek checkpoint's
names; with `mlp="moe"` the target's MoE block instead (see `HeadMoE`).

The embeddings, final norm and lm_head are the target's, frozen, and held as buffers so they
are in no optimizer and no checkpoint. Parameter names are the native export format's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref import deepseek_v2 as ds
from inference_ref.config import LlamaConfig
from inference_ref.draft import VARIANTS, check_mlp
from inference_ref.llama import RMSNorm, Rotary, apply_rotary, rms_norm
from inference_ref.target import TargetConfig
from mtp_train.head_attention import Segments, head_attention


@dataclass(frozen=True)
class HeadConfig:
    variant: str
    """`rmsnorm-restored` or `eagle1`."""
    target: TargetConfig
    """The target's config: the head's layer is one layer of this shape and kind."""
    mlp: str = "dense"
    """The layer's MLP: `dense`, or `moe` (the target's MoE block; DeepSeek-V2 targets only)."""

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"model.variant: {self.variant!r} is not one of {VARIANTS}")
        check_mlp(self.mlp, self.target.model_type, "model.head_mlp")

    @property
    def restored(self) -> bool:
        return self.variant == "rmsnorm-restored"


class HeadAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
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


# The head's attention for each target kind.
ATTENTION = {LlamaConfig.model_type: HeadAttention, ds.DeepseekV2Config.model_type: LatentHeadAttention}


class HeadMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def head_mlp(cfg: TargetConfig, mlp: str) -> nn.Module:
    if mlp == "moe":
        return HeadMoE(cfg)
    return HeadMLP(cfg.hidden_size, cfg.intermediate_size)


class HeadLayer(nn.Module):
    """One decoder layer of the target's kind; eagle1 drops the input norm."""

    def __init__(self, cfg: TargetConfig, input_norm: bool, mlp: str = "dense"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = ATTENTION[cfg.model_type](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = head_mlp(cfg, mlp)

    def forward(self, x, positions, batch: Segments, kv: list):
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPHead(nn.Module):
    def __init__(self, cfg: HeadConfig, frozen: dict[str, torch.Tensor]):
        super().__init__()
        t = cfg.target
        self.cfg = cfg
        h = t.hidden_size
        if cfg.restored:
            self.enorm = RMSNorm(h, t.rms_norm_eps)
            self.hnorm = RMSNorm(h, t.rms_norm_eps)
            self.norm = RMSNorm(h, t.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=not cfg.restored)
        self.layer = HeadLayer(t, input_norm=cfg.restored, mlp=cfg.mlp)
        self.register_buffer("embed_weight", frozen["model.embed_tokens.weight"], persistent=False)
        self.register_buffer("final_norm_weight", frozen["model.norm.weight"], persistent=False)
        self.register_buffer("lm_head_weight", frozen["lm_head.weight"], persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Norms start at the target's final norm (z lives where final_norm(h) does); linears, the
        router and the stacked experts small."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p)
        if self.cfg.restored:
            with torch.no_grad():
                self.norm.weight.copy_(self.final_norm_weight)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen final norm."""
        return rms_norm(h, self.final_norm_weight, self.cfg.target.rms_norm_eps)

    def project(self, state: torch.Tensor, token_ids: torch.Tensor, first: bool) -> torch.Tensor:
        """fc input from (state, next token). `state` is the target's h (first step) or the head's y."""
        e = F.embedding(token_ids, self.embed_weight).to(state.dtype)
        if self.cfg.restored:
            return self.fc(torch.cat([self.enorm(e), self.hnorm(state)], -1))
        # eagle1 reads features f = final_norm(h); its own y already lives in that space.
        f = self.final_norm(state) if first else state
        return self.fc(torch.cat([e, f], -1))

    def output_state(self, y: torch.Tensor) -> torch.Tensor:
        """z: the state whose logits are taken and that is regressed to final_norm(h_{i+1})."""
        return self.norm(y) if self.cfg.restored else y

    def forward(self, hidden, token_ids, positions, batch, steps: int = 1) -> torch.Tensor:
        """Chained forward over packed draft positions.

        hidden [T, H]: the target's h_i; token_ids [steps, T]: row j holds the token fed at depth
        j + 1 for position i (row 0 is t_{i+1}); positions [T]. Returns y [steps, T, H], pre-norm.
        Step j ≥ 1 reads step j-1's y at the same i, at rope position i + j, and attends to the
        step-0 keys ≤ i plus its own chain's keys (as a draft's KV cache holds them when serving).
        """
        kv, ys, state = [], [], hidden
        for j in range(steps):
            x = self.project(state, token_ids[j], first=(j == 0))
            state = self.layer(x, positions + j, batch, kv)
            ys.append(state)
        return torch.stack(ys)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return F.linear(z, self.lm_head_weight.to(z.dtype))
