"""DeepSeek-V2 target (V2-Lite shape) for inference: packed forward (precompute) and latent-cache decode.

Same interface as `inference_ref.llama.LlamaModel`: `forward_packed`, `new_cache`, `forward_cached`,
`logits`, with hidden states returned *before* the final norm.

Two parts differ from Llama:

- Multi-head latent attention (MLA). Keys and values come from one compressed latent per token
  (`kv_lora_rank` wide, after `kv_a_layernorm`) plus one rotated key part shared by all heads
  (`qk_rope_head_dim`). The decode cache holds only those two, 576 numbers per token and layer
  for V2-Lite instead of 16 heads × (192 + 128) for full K/V.
- Mixture of experts: after `first_k_dense_replace` dense layers, each layer routes a token to
  `num_experts_per_tok` of `n_routed_experts` experts (softmax gate) and adds `n_shared_experts`
  always-on experts. Expert weights are stacked [E, ...] and run as grouped matmuls.

Rotary embeddings rotate interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints expect,
not Llama's halves, and YaRN scaling changes both the rope magnitude and the softmax scale.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.attention import cache_slots, packed_causal_attention
from inference_ref.config import eos_token_ids
from inference_ref.llama import CausalLM, Fp32Frequencies, RMSNorm
from inference_ref.loading import EMBED, FINAL_NORM, LM_HEAD, init_random, read_tensors, safetensors_files

# Both DeepSeek and transformers build q_a_layernorm / kv_a_layernorm with the default eps, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (`rope_type: yarn`) as DeepSeek-V2 configures it."""

    factor: float
    """Context extension factor: low frequencies are divided by it."""
    original_max_position_embeddings: int
    """Context length of pre-training, before the extension."""
    beta_fast: float = 32.0
    """Frequencies turning more than this many times over the original context are kept."""
    beta_slow: float = 1.0
    """Frequencies turning fewer than this many times are divided by `factor`; a ramp between."""
    mscale: float | None = None
    """With `mscale_all_dim`, sets the magnitude of cos/sin (see `rope_magnitude`)."""
    mscale_all_dim: float | None = None
    """Multiplies the softmax scale by yarn_mscale(factor, mscale_all_dim)²."""
    attention_factor: float | None = None
    """An explicit magnitude of cos/sin, overriding the one derived from `mscale`."""


@dataclass(frozen=True)
class DeepseekV2Config:
    """Shape of a `DeepseekV2ForCausalLM` checkpoint (DeepSeek-V2, V2-Lite, Coder-V2)."""

    model_type: ClassVar[str] = "deepseek_v2"

    vocab_size: int
    hidden_size: int
    """Residual stream width (2048 for V2-Lite)."""
    intermediate_size: int
    """Width of the dense layers' MLP (the first `first_k_dense_replace` layers)."""
    moe_intermediate_size: int
    """Width of one routed expert; the shared experts run as one MLP `n_shared_experts` times as wide."""
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    """Width of the compressed KV latent, the part of the decode cache shared by all heads."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding (up-projected from the latent)."""
    qk_rope_head_dim: int
    """Rotary query/key width; the key's rotary part is one vector shared by all heads."""
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    """Routed experts each token goes to (top-k of the softmax gate)."""
    n_shared_experts: int
    first_k_dense_replace: int
    """Layers 0 … first_k_dense_replace − 1 have a dense MLP, the rest mixture of experts."""
    q_lora_rank: int | None = None
    """Width of the query's low-rank down-projection; None (V2-Lite): one full-rank q_proj."""
    moe_layer_freq: int = 1
    """Every layer past the dense ones is MoE; the only value transformers implements."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' gate weights (16 for V2, 1 for V2-Lite)."""
    topk_method: str = "greedy"
    """`greedy` (top-k over all experts) or `group_limited_greedy` (top-k within the best groups)."""
    n_group: int | None = None
    """Expert groups for `group_limited_greedy`."""
    topk_group: int | None = None
    """Groups kept per token for `group_limited_greedy`, ranked by their best expert's score."""
    norm_topk_prob: bool = False
    """Must be False: transformers' DeepseekV2 ignores it, DeepSeek's own code renormalizes."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: dict) -> DeepseekV2Config:
        """Build from the dict of a Hugging Face `config.json` (the hub's DeepSeek files or
        transformers 5.x `save_pretrained`)."""
        check_supported(hf)
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        eos = eos_token_ids(hf)
        max_pos = hf.get("max_position_embeddings", 163840)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_routed_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            n_shared_experts=hf.get("n_shared_experts") or 0,
            first_k_dense_replace=hf.get("first_k_dense_replace", 0),
            q_lora_rank=hf.get("q_lora_rank"),
            moe_layer_freq=hf.get("moe_layer_freq", 1),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            topk_method=hf.get("topk_method") or "greedy",
            n_group=hf.get("n_group"),
            topk_group=hf.get("topk_group"),
            norm_topk_prob=bool(hf.get("norm_topk_prob")),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=yarn_from_hf(rope, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def to_hf(self) -> dict:
        """The `config.json` dict transformers' `DeepseekV2ForCausalLM` reads back to this shape."""
        hf = {k: v for k, v in asdict(self).items() if k not in ("rope_scaling", "eos_token_ids")}
        hf.update(
            architectures=["DeepseekV2ForCausalLM"],
            model_type=self.model_type,
            hidden_act="silu",
            num_key_value_heads=self.num_attention_heads,
            eos_token_id=list(self.eos_token_ids) or None,
            rope_scaling=None,
        )
        if self.rope_scaling is not None:
            scaling = {k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
            hf["rope_scaling"] = {"rope_type": "yarn", **scaling}
        return hf

    def fingerprint(self) -> str:
        """A short hash of the shape, recorded in stores and exported heads to match them to targets."""
        text = json.dumps({"model_type": self.model_type, **asdict(self)}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_supported(hf: dict) -> None:
    """Raise on DeepSeek-V2 options this implementation (and transformers') does not run."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    unsupported = {
        "kv_lora_rank must be set (MLA)": hf.get("kv_lora_rank") is None,
        "topk_method must be greedy or group_limited_greedy": hf.get("topk_method", "greedy")
        not in (None, "greedy", "group_limited_greedy"),
        "scoring_func must be softmax": hf.get("scoring_func", "softmax") != "softmax",
        "norm_topk_prob must be false (transformers ignores it, DeepSeek renormalizes)": bool(
            hf.get("norm_topk_prob")
        ),
        "moe_layer_freq must be 1 (transformers ignores it)": hf.get("moe_layer_freq", 1) != 1,
        "hidden_act must be silu": hf.get("hidden_act", "silu") != "silu",
        "attention_bias / mlp_bias must be false": bool(hf.get("attention_bias") or hf.get("mlp_bias")),
        "num_key_value_heads must equal num_attention_heads": hf.get("num_key_value_heads")
        not in (None, hf.get("num_attention_heads")),
        "rope_type must be default or yarn": rope.get("rope_type", rope.get("type", "default"))
        not in ("default", "yarn"),
        "yarn truncate must be true": rope.get("truncate", True) is not True,
    }
    problems = [what for what, bad in unsupported.items() if bad]
    if problems:
        raise ValueError(f"config.json: unsupported DeepSeek-V2 options: {'; '.join(problems)}")


def yarn_from_hf(rope: dict, max_position_embeddings: int) -> YarnScaling | None:
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    return YarnScaling(
        # transformers: a missing factor is the context extension itself.
        factor=rope.get("factor") or max_position_embeddings / original,
        original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0,
        beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
    )


def read_deepseek_v2_config(path: str | Path) -> DeepseekV2Config:
    """Read `config.json` from a checkpoint directory."""
    return DeepseekV2Config.from_hf(json.loads((Path(path) / "config.json").read_text()))


# ---------------------------------------------------------------------------------------------
# Rotary embedding with YaRN


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_magnitude(cfg: DeepseekV2Config) -> float:
    """The factor on cos/sin (so on q_rope and k_rope both), transformers' `attention_factor`."""
    s = cfg.rope_scaling
    if s is None:
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(cfg: DeepseekV2Config) -> float:
    """1/sqrt(qk_head_dim), times yarn_mscale(factor, mscale_all_dim)² under YaRN: the long-context
    temperature correction, applied to the whole score (nope and rope parts)."""
    scale = cfg.qk_head_dim**-0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def rope_inv_freq(cfg: DeepseekV2Config) -> torch.Tensor:
    """Inverse frequencies [qk_rope_head_dim / 2], YaRN-scaled where configured."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    s = cfg.rope_scaling
    if s is None:
        return 1.0 / pos_freqs

    # YaRN: a frequency that turns fewer than beta_slow times over the original context is divided
    # by `factor` (interpolated), one that turns more than beta_fast times is kept, a ramp between.
    def dim_of(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(dim_of(s.beta_fast)), 0)
    high = min(math.ceil(dim_of(s.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    kept = 1 - ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    # Written as transformers writes it, (1 − kept) and all, so the table is bit-identical.
    return (1.0 / (s.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


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


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention


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
    (qk_rope_head_dim). Entries past a row's length are scratch, as in `llama.KVCache`."""

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
        """The same storage with every row `n` entries longer (see `llama.KVCache.shifted`)."""
        return LatentCache(self.kv, self.lengths + n)

    def slots(self, new: int, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, new] the next `new` tokens take, and their mask (`attention.cache_slots`)."""
        return cache_slots(self.lengths, self.max_len, new, static)


# ---------------------------------------------------------------------------------------------
# Feed-forward: dense MLP and mixture of experts


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Softmax gate: per token the top-k experts and their weights. Runs in fp32 (the loader keeps
    its weight fp32, as transformers does): a bf16 gate flips near-tied expert choices."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → fp32 weights [T, k] and expert ids [T, k]."""
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).softmax(-1)
        if c.topk_method == "group_limited_greedy":
            # Keep the topk_group groups holding the best-scoring experts; zero the others.
            groups = scores.unflatten(-1, (c.n_group, -1))
            best = groups.amax(-1).topk(c.topk_group, -1, sorted=False).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(-1, best, True)
            scores = groups.masked_fill(~keep[..., None], 0.0).flatten(-2)
        weights, ids = scores.topk(c.num_experts_per_tok, -1, sorted=False)
        return weights * c.routed_scaling_factor, ids


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_grouped_failed: str | None = None  # why the grouped kernel was given up on, once, if it was


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, rows ends[e-1] … ends[e] − 1 going to expert e; weight
    [E, out, in] → [N, out]. One grouped-GEMM kernel where torch has one for this device and
    dtype: no host sync, so a decode step stays capturable as a CUDA graph."""
    global _grouped_failed
    if _GROUPED_MM is not None and _grouped_failed is None:
        try:
            return _GROUPED_MM(x, weight.transpose(-2, -1), offs=ends)
        except torch.OutOfMemoryError:
            raise  # a property of this batch (a training step's, say), not of the kernel
        except (RuntimeError, NotImplementedError) as e:
            # An older build, or a dtype / alignment its kernel lacks: fall back for good.
            _grouped_failed = f"{type(e).__name__}: {e}"
    return grouped_linear_loop(x, weight, ends)


def grouped_linear_loop(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The same as `grouped_linear`, one matmul per expert that received rows (one host sync)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].T
        start = end
    return out


def grouped_kernel() -> str:
    """Which routed-expert matmul `grouped_linear` uses (reported by benchmarks)."""
    if _GROUPED_MM is None or _grouped_failed is not None:
        return f"one matmul per expert ({_grouped_failed or 'no grouped_mm in this torch'})"
    return "grouped_mm"


class Experts(nn.Module):
    """The routed experts, stacked: gate|up [E, 2I, H] (fused as in the dense MLP), down [E, H, I]."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, linear=grouped_linear):
        """x [T, H], weights/ids [T, k] → Σ_k weight · expert(x) [T, H]."""
        k = ids.shape[1]
        # Sort the T·k (token, expert) pairs by expert so each expert's rows are contiguous.
        order = ids.flatten().argsort(stable=True)
        experts = torch.arange(self.gate_up_proj.shape[0], device=ids.device)
        ends = torch.searchsorted(ids.flatten()[order], experts, right=True).to(torch.int32)
        gate, up = linear(x[order // k], self.gate_up_proj, ends).chunk(2, dim=-1)
        out = linear(F.silu(gate) * up, self.down_proj, ends)
        # Back to (token, slot) order and a fixed-order sum over the k slots: deterministic,
        # unlike an index_add of T·k rows.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        weighted = unsorted.view(*ids.shape, -1).float() * weights[..., None]
        return weighted.sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = self.experts(flat, *self.router(flat))
        return routed.view_as(x) + self.shared_experts(x)


# ---------------------------------------------------------------------------------------------
# The model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward_packed(self, x, cos, sin, cu_seqlens, max_len):
        x = x + self.self_attn.forward_packed(self.input_layernorm(x), cos, sin, cu_seqlens, max_len)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, cache, slots, mask):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(CausalLM):
    """`DeepseekV2ForCausalLM` with fused input projections and stacked experts."""

    compilable = False  # compiled layers are not measured on the MoE block (data-dependent shapes)

    def __init__(self, cfg: DeepseekV2Config):
        layers = [DecoderLayer(cfg, cfg.is_moe(i)) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, Rotary(cfg), LatentCache)


# ---------------------------------------------------------------------------------------------
# Loading: Hugging Face names ↔ this model's fused and stacked ones


def _cat(hf: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([hf[n] for n in names], 0)


def fuse_experts(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config, prefix: str) -> dict[str, torch.Tensor]:
    """Routed experts under `prefix` (`model.layers.N.mlp.experts.`) → stacked gate|up and down.

    Hub checkpoints and `save_pretrained` store one tensor per expert and projection; transformers
    5.x holds them stacked in memory (`experts.gate_up_proj` [E, 2I, H], gate rows first)."""
    if prefix + "gate_up_proj" in hf:
        return {"gate_up_proj": hf[prefix + "gate_up_proj"], "down_proj": hf[prefix + "down_proj"]}
    experts = [f"{prefix}{e}." for e in range(cfg.n_routed_experts)]
    gate_up = [_cat(hf, [e + "gate_proj.weight", e + "up_proj.weight"]) for e in experts]
    down = [hf[e + "down_proj.weight"] for e in experts]
    return {"gate_up_proj": torch.stack(gate_up), "down_proj": torch.stack(down)}


def fuse_layer(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config, i: int) -> dict[str, torch.Tensor]:
    """Layer i's Hugging Face tensors → this model's names (q | kv_a fused, gate | up fused, experts stacked)."""
    p, q = f"model.layers.{i}.", f"layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    q_in = "q_a_proj" if cfg.q_lora_rank else "q_proj"
    out = {
        q + "self_attn.q_kv_a_proj.weight": _cat(hf, [f"{a}{q_in}.weight", a + "kv_a_proj_with_mqa.weight"]),
    }
    renamed = ["input_layernorm", "post_attention_layernorm"] + [
        "self_attn." + n for n in ("kv_a_layernorm", "kv_b_proj", "o_proj", "q_a_layernorm", "q_b_proj")
    ]
    out.update({f"{q}{n}.weight": hf[f"{p}{n}.weight"] for n in renamed if f"{p}{n}.weight" in hf})
    shared = m + "shared_experts." if cfg.is_moe(i) else m
    mlp = q + ("mlp.shared_experts." if cfg.is_moe(i) else "mlp.")
    out[mlp + "gate_up_proj.weight"] = _cat(hf, [shared + "gate_proj.weight", shared + "up_proj.weight"])
    out[mlp + "down_proj.weight"] = hf[shared + "down_proj.weight"]
    if cfg.is_moe(i):
        out[q + "mlp.router.weight"] = hf[m + "gate.weight"]
        experts = fuse_experts(hf, cfg, m + "experts.")
        out.update({q + "mlp.experts." + k: v for k, v in experts.items()})
    return out


def fuse_top(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config) -> dict[str, torch.Tensor]:
    lm_head = hf[EMBED] if cfg.tie_word_embeddings else hf[LM_HEAD]
    return {"embed_tokens.weight": hf[EMBED], "norm.weight": hf[FINAL_NORM], "lm_head.weight": lm_head}


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config) -> dict[str, torch.Tensor]:
    """A whole Hugging Face state dict (per-expert or stacked experts) → this model's names."""
    out = fuse_top(hf, cfg)
    for i in range(cfg.num_hidden_layers):
        out.update(fuse_layer(hf, cfg, i))
    return out


def hf_state_dict(model: DeepseekV2Model, stacked: bool = False) -> dict[str, torch.Tensor]:
    """This model's weights under Hugging Face names: one tensor per expert as in hub checkpoints
    and `save_pretrained`, or `stacked` as transformers 5.x holds them (its `load_state_dict`)."""
    cfg = model.cfg
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    out = {EMBED: sd["embed_tokens.weight"], FINAL_NORM: sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for name, tensor in sd.items():
            if name.startswith(q):
                out.update(_unfuse(p, name[len(q) :], tensor, cfg, stacked))
    return out


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    """A fused gate | up weight → its gate and up rows."""
    return [h.contiguous() for h in t.chunk(2, dim=-2)]


def _unfuse(
    p: str, name: str, t: torch.Tensor, cfg: DeepseekV2Config, stacked: bool
) -> dict[str, torch.Tensor]:
    """One of layer p's tensors (`name` relative to the layer) → its Hugging Face tensors."""
    if name == "self_attn.q_kv_a_proj.weight":
        q_in = "q_a_proj" if cfg.q_lora_rank else "q_proj"
        kv_rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        wq, wkv = (w.contiguous() for w in t.split([t.shape[0] - kv_rows, kv_rows]))
        return {f"{p}self_attn.{q_in}.weight": wq, f"{p}self_attn.kv_a_proj_with_mqa.weight": wkv}
    if name == "mlp.router.weight":
        return {p + "mlp.gate.weight": t}
    if name.startswith("mlp.experts.") and stacked:
        return {p + name: t}
    if name == "mlp.experts.gate_up_proj":
        return {
            f"{p}mlp.experts.{e}.{proj}.weight": w
            for e, expert in enumerate(t)
            for proj, w in zip(("gate_proj", "up_proj"), _halves(expert))
        }
    if name == "mlp.experts.down_proj":
        return {f"{p}mlp.experts.{e}.down_proj.weight": w.contiguous() for e, w in enumerate(t)}
    if name.endswith("gate_up_proj.weight"):
        base = p + name.removesuffix("gate_up_proj.weight")
        gate, up = _halves(t)
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    return {p + name: t}


def placed(state: dict[str, torch.Tensor], device, dtype) -> dict[str, torch.Tensor]:
    """`state` on `device` in `dtype`, except a router, which stays fp32 whatever the model's
    dtype, as transformers keeps it (see `Router`)."""
    return {
        k: v.to(device, torch.float32 if k.endswith("router.weight") else dtype) for k, v in state.items()
    }


def build_model(
    cfg: DeepseekV2Config, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32
) -> DeepseekV2Model:
    """Assemble a model from a fused state dict without allocating random weights first."""
    with torch.device("meta"):
        model = DeepseekV2Model(cfg)
    model.load_state_dict(placed(state, device, dtype), strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)  # fp32 frequencies whatever the weights' dtype
    return model.eval().requires_grad_(False)


def load_deepseek_v2(path: str | Path, device="cpu", dtype=torch.float32) -> DeepseekV2Model:
    """Load a target from a Hugging Face directory (safetensors only, read by tensor name)."""
    path = Path(path)
    cfg = read_deepseek_v2_config(path)
    names = list(safetensors_files(path))
    top = [EMBED, FINAL_NORM] + ([] if cfg.tie_word_embeddings else [LM_HEAD])
    state = placed(fuse_top(read_tensors(path, top), cfg), device, dtype)
    for i in range(cfg.num_hidden_layers):
        # One layer at a time, placed before the next is read: host memory holds one layer's
        # tensors (about 1.2 GB for V2-Lite), not the 31 GB checkpoint and its fused copy.
        prefix = f"model.layers.{i}."
        layer = read_tensors(path, [n for n in names if n.startswith(prefix)])
        state.update(placed(fuse_layer(layer, cfg, i), device, dtype))
    return build_model(cfg, state, device, dtype)


def random_deepseek_v2(
    cfg: DeepseekV2Config, device="cpu", dtype=torch.float32, seed: int = 0
) -> DeepseekV2Model:
    """Random weights at a given shape (benchmarks, tiny test targets), made on `device` in
    `dtype` directly: V2-Lite's 15.7B parameters would take minutes to initialise on the host."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV2Model(cfg).to(dtype)
    model.to_empty(device=device)
    init_random(model)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # as `placed` keeps it: routing in fp32, as transformers does
    model.rotary = Rotary(cfg).to(device)  # to_empty left its table uninitialised
    return model.eval().requires_grad_(False)
