"""The rmsnorm-restored and eagle1 heads for training: architecture only (no optimizer, launcher or
logging here). What every head shares is `base.DraftHead`; the math is `inference_ref.head_spec`'s
(one description for training, serving and export). `layer` is one decoder layer of the target's
kind, trained over packed chained steps:
its attention comes from the kind's module here (`HEAD_LAYERS`), by default with a dense SwiGLU MLP
of the target's `intermediate_size`, or with `mlp="moe"` the target's MoE block.

"""

from __future__ import annotations

from torch import nn

from inference_ref.causal_lm import RMSNorm
from inference_ref.head_spec import HeadSpec, Symbolic
from inference_ref.target import TargetConfig
from mtp_train.head_attention import Segments
from mtp_train.heads.base import DraftHead
from mtp_train.heads.layers import HEAD_LAYERS
from mtp_train.heads.llama import HeadMLP


def head_mlp(cfg: TargetConfig, mlp: str) -> nn.Module:
    if mlp == "moe":
        return HEAD_LAYERS[cfg.model_type].moe(cfg)
    return HeadMLP(cfg.hidden_size, cfg.intermediate_size)


class HeadLayer(nn.Module):
    """One decoder layer of the target's kind; eagle1 drops the input norm. `attention`: another
    kind's attention (an EAGLE-3 head's stacked layers are Llama's whatever the target)."""

    def __init__(
        self,
        cfg: TargetConfig,
        input_norm: bool,
        mlp: str = "dense",
        attention: type[nn.Module] | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = (attention or HEAD_LAYERS[cfg.model_type].attention)(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = head_mlp(cfg, mlp)

    def forward(self, x, positions, batch: Segments, kv: list):
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPHead(DraftHead):
    """The restored and eagle1 heads: fc over [e; the target's last-layer state], one decoder layer
    of the target's kind (eagle1's without its input norm)."""

    def build_layer(self, spec: HeadSpec) -> nn.Module:
        return HeadLayer(spec.target, input_norm=spec.kind.math.layer_input_norm, mlp=spec.mlp)

    @classmethod
    def native_block(cls, spec: HeadSpec) -> tuple[Symbolic, dict[str, int]]:
        return HEAD_LAYERS[spec.target.model_type].native_block(spec.target, spec.mlp)
