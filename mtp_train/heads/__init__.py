"""Draft heads for training: `MTPHead` (the module), one decoder-layer module per target kind
(`llama`, `deepseek_v2`) and their table (`kinds.LAYER_KINDS`)."""

from inference_ref.head_spec import HeadSpec
from mtp_train.heads.mtp import HeadLayer, MTPHead

__all__ = ["HeadLayer", "HeadSpec", "MTPHead"]
