"""A training head's decoder layer for each target kind: one module per kind, one entry here.

The serving side's counterpart is `inference_ref.models.KINDS` (`head_layer`, `fuse_head_layer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from mtp_train.heads import deepseek_v2, llama, qwen3


class HeadLayerKind(NamedTuple):
    attention: type[nn.Module]
    """Attention over packed chained steps: `(x, positions, segments, kv)` → output."""
    native_block: Callable
    """`(cfg, mlp)` → the layer's native names (under `layer.`) and shape symbols."""
    moe: type[nn.Module] | None = None
    """The target's MoE block, for heads with `mlp="moe"`."""


LAYER_KINDS: dict[str, HeadLayerKind] = {
    "llama": HeadLayerKind(llama.HeadAttention, llama.native_block),
    "qwen3": HeadLayerKind(qwen3.Qwen3HeadAttention, qwen3.native_block),
    "qwen3_moe": HeadLayerKind(qwen3.Qwen3HeadAttention, qwen3.native_block),  # a dense Qwen3 head layer
    "deepseek_v2": HeadLayerKind(
        deepseek_v2.LatentHeadAttention, deepseek_v2.native_block, deepseek_v2.HeadMoE
    ),
    "deepseek_v3": HeadLayerKind(  # V2's MLA and MoE modules; the router follows the config
        deepseek_v2.LatentHeadAttention, deepseek_v2.native_block, deepseek_v2.HeadMoE
    ),
}
