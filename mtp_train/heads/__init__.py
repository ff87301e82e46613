"""Draft heads for training: what every head shares (`base.DraftHead`), the restored and eagle1
heads (`mtp.MTPHead`), `eagle3.Eagle3Head`, one decoder-layer module per target kind (`llama`,
`qwen3`, `deepseek_v2`) and their table (`layers.HEAD_LAYERS`); `build` makes the head a spec names."""

import torch

from inference_ref.head_spec import HeadSpec, resolve_class
from mtp_train.heads.base import DraftHead
from mtp_train.heads.eagle3 import Eagle3Head
from mtp_train.heads.mtp import HeadLayer, MTPHead

__all__ = ["DraftHead", "Eagle3Head", "HeadLayer", "HeadSpec", "MTPHead", "build", "head_class"]


def head_class(spec: HeadSpec) -> type[DraftHead]:
    """The training class of `spec`'s head kind (its registry entry names it)."""
    return resolve_class(spec.kind.training)


def build(
    spec: HeadSpec, frozen: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None
) -> DraftHead:
    """The training head of `spec`'s kind on the target's frozen tensors (`draft_ids`: the draft
    vocabulary's target ids, None for the whole target vocabulary)."""
    return head_class(spec)(spec, frozen, draft_ids)
