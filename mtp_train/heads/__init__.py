"""Draft heads for training: `MTPHead` (rmsnorm-restored and eagle1), `Eagle3Head`, one
decoder-layer module per target kind (`llama`, `deepseek_v2`) and their table (`kinds.LAYER_KINDS`);
`build` makes the head a spec names."""

import torch

from inference_ref.head_spec import HeadSpec
from mtp_train.heads.eagle3 import Eagle3Head
from mtp_train.heads.mtp import HeadLayer, MTPHead

__all__ = ["Eagle3Head", "HeadLayer", "HeadSpec", "MTPHead", "build"]


def build(spec: HeadSpec, frozen: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None) -> MTPHead:
    """The training head of `spec`'s kind on the target's frozen tensors (`draft_ids`: the draft
    vocabulary's target ids, None for the whole target vocabulary)."""
    if spec.kind.reads_aux:
        return Eagle3Head(spec, frozen, draft_ids)
    return MTPHead(spec, frozen, draft_ids)
