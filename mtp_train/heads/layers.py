"""A training head's decoder layer for each target kind: one module per kind, one entry here.

The serving side's counterpart is `inference_ref.models.TARGET_KINDS` (`head_layer`, `fuse_head_layer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from mtp_train.heads import deepseek_v2, llama, qwen3


class HeadLayerParts(NamedTuple):
    attention: type[nn.Module]
    """Attention over packed chained steps: `(x, positions, segments, kv)` → output."""
    native_block: Callable
    """`(cfg, mlp)` → the layer's native names (under `layer.`) and shape symbols."""
    moe: type[nn.Module] | None = None
    """The target's MoE block, for heads with `mlp="moe"`."""


HEAD_LAYERS: dict[str, HeadLayerParts] = {
    "llama": HeadLayerParts(llama.HeadAttention, llama.native_block),
    "qwen3": HeadLayerParts(qwen3.Qwen3HeadAttention, qwen3.native_block),
    "qwen3_moe": HeadLayerParts(qwen3.Qwen3HeadAttention, qwen3.native_block),  # a dense Qwen3 head layer
    "deepseek_v2": HeadLayerParts(
        deepseek_v2.LatentHeadAttention, deepseek_v2.native_block, deepseek_v2.HeadMoE
    ),
    "deepseek_v3": HeadLayerParts(  # V2's MLA and MoE modules; the router follows the config
        deepseek_v2.LatentHeadAttention, deepseek_v2.native_block, deepseek_v2.HeadMoE
    ),
}
