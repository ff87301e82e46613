"""DeepSeek-V3 target (V3, R1 and their derivatives): DeepSeek-V2's model — MLA, latent cache, YaRN,
grouped-matmul experts, dense layers before `first_k_dense_replace` — with V3's routing: sigmoid
scores, the `e_score_correction_bias` that picks experts without an auxiliary loss, group-limited
top-k over the groups whose two best experts score highest (`noaux_tc`), renormalized top-k weights
(`norm_topk_prob`) × `routed_scaling_factor` (`deepseek_v2.moe.Router`). The checkpoint's MTP layer
(`model.layers.{num_hidden_layers}`) is not part of the target; a head can start from it.

The hub checkpoints store weights in FP8 with 128×128 block scales (`weight_scale_inv`): they load
as they are, dequantized tile by tile as they are read (`loading.read_tensors`); with
`model.quantization=fp8` the linear maps are then FP8 again, with per-channel scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from inference_ref.models import deepseek_v2
from inference_ref.models.deepseek_v2.config import DeepseekV2Config


@dataclass(frozen=True)
class DeepseekV3Config(DeepseekV2Config):
    """Shape of a `DeepseekV3ForCausalLM` checkpoint (DeepSeek-V2's fields, V3's routing)."""

    model_type: ClassVar[str] = "deepseek_v3"

    @classmethod
    def check(cls, hf: dict) -> None:
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        unsupported = {
            "kv_lora_rank must be set (MLA)": hf.get("kv_lora_rank") is None,
            "scoring_func must be sigmoid": hf.get("scoring_func", "sigmoid") != "sigmoid",
            "topk_method must be noaux_tc": hf.get("topk_method", "noaux_tc") != "noaux_tc",
            "rope_interleave must be true": hf.get("rope_interleave", True) is not True,
            "moe_layer_freq must be 1": hf.get("moe_layer_freq", 1) != 1,
            "hidden_act must be silu": hf.get("hidden_act", "silu") != "silu",
            "attention_bias must be false": bool(hf.get("attention_bias")),
            "rope_type must be default or yarn": rope.get("rope_type", rope.get("type", "default"))
            not in ("default", "yarn"),
            "quantization_config must be fp8 with 128×128 weight blocks": "quantization_config" in hf
            and (
                hf["quantization_config"].get("quant_method") != "fp8"
                or list(hf["quantization_config"].get("weight_block_size", [128, 128])) != [128, 128]
            ),
        }
        problems = [what for what, bad in unsupported.items() if bad]
        if problems:
            raise ValueError(f"config.json: unsupported DeepSeek-V3 options: {'; '.join(problems)}")

    @classmethod
    def from_hf(cls, hf: dict) -> DeepseekV3Config:
        cfg = super().from_hf(hf)
        return dataclasses.replace(
            cfg, topk_method="noaux_tc", norm_topk_prob=bool(hf.get("norm_topk_prob", True))
        )

    def to_hf(self) -> dict:
        return {
            **super().to_hf(),
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": self.model_type,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "rope_interleave": True,
        }


load_deepseek_v3 = partial(deepseek_v2.load_deepseek_v2, config_class=DeepseekV3Config)

# The debug shape: V2's tiny one with V3's routing (8 experts in 4 groups, 2 groups kept, top 2).
TINY = {
    **deepseek_v2.TINY,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "q_lora_rank": 24,
}
