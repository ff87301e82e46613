"""DeepSeek-V2 configuration: the checkpoint's shape, YaRN rope scaling and the scales it sets."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from inference_ref.causal_lm import config_fingerprint, eos_token_ids

# Both DeepSeek and transformers build q_a_layernorm / kv_a_layernorm with the default eps, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


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
        cls.check(hf)
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
            n_routed_experts=hf["n_routed_experts"] if "n_routed_experts" in hf else hf["num_local_experts"],
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
        return config_fingerprint({"model_type": self.model_type, **asdict(self)})

    @classmethod
    def check(cls, hf: dict) -> None:
        """Refuse the options this kind does not run (`check_supported`)."""
        check_supported(hf)


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
