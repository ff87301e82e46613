"""A randomly initialized draft head for a benchmark's target, exported and loaded as serving loads
it (`inference_ref.draft.load_draft`): what the cost benchmark times a draft step of, and what the
projection's check drafts with. Its acceptance is that of a random head; its cost is the head's."""

from __future__ import annotations

import tempfile

import torch

from inference_ref.draft import load_draft
from inference_ref.draft_base import Draft
from inference_ref.head_spec import HEAD_KINDS, HeadSpec
from mtp_train.export import save_head
from mtp_train.heads import build


def head_spec(variant: str, cfg) -> HeadSpec:
    """A head of `variant` for a target of `cfg`, its kind's defaults for the rest: the aux layers
    and draft vocabulary an EAGLE-3 head reads and scores (32,000 rows on a vocabulary of 100k or
    more), none for the kinds without them."""
    kind = HEAD_KINDS[variant]
    return HeadSpec(
        variant,
        cfg,
        aux_layers=kind.aux_layers(None, cfg.num_hidden_layers),
        draft_vocab_size=kind.default_draft_vocab(cfg.vocab_size),
    )


def random_draft(target, spec: HeadSpec) -> Draft:
    """A head of `spec` on the target's frozen tensors, random otherwise; a draft vocabulary is the
    first ids (which ids does not change a cost)."""
    frozen = {
        "model.embed_tokens.weight": target.embed_tokens.weight.float().cpu(),
        "model.norm.weight": target.norm.weight.float().cpu(),
        "lm_head.weight": target.lm_head.weight.float().cpu(),
    }
    torch.manual_seed(0)
    draft_ids = torch.arange(spec.draft_vocab_size) if spec.draft_vocab_size else None
    head = build(spec, frozen, draft_ids)
    with tempfile.TemporaryDirectory() as directory:
        save_head(head, directory, {"config_hash": spec.target.fingerprint()}, {})
        return load_draft(directory, target)
