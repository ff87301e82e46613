"""The draft head for serving: loads the native export and runs it through its own KV cache.

What every draft shares is `draft_base.Draft`; the head's description and math (`HeadSpec`, its
kind's `math`) are `inference_ref.head_spec`'s, shared with the training module
`mtp_train.heads.MTPHead`. The restored and eagle1 drafts' decoder layer is the target's kind,
built by its registry entry (`TargetKind.head_layer`): a Llama layer with a KV cache, or for a
DeepSeek-V2 target an MLA layer with a latent cache, attending in the latent space as the target's
decode does, and a dense MLP or (config.json `"mlp": "moe"`) the target's MoE block.

The state fed to `project` is the target's pre-norm state h_i for an entry made from the target, or the draft's own y
for a chained step. Positions (DESIGN "Chained drafting"): the entry for (h_i, t_{i+1}) sits at
cache slot and rope position i and predicts t_{i+2}; chained step j ≥ 1 from base i sits at slot
and position i + j and sees the committed entries 0 … i plus its own chain's steps 1 … j.

Native format: a directory with `head.safetensors` (the training module's parameter names,
unfused) and `config.json` (`format: mtp-train-head`, see `HeadSpec.from_config`). Embeddings,
final norm and lm_head are the target's unless the file stores `embed_tokens.weight` /
`lm_head.weight`.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from inference_ref.draft_base import Draft, fuse_head_state
from inference_ref.head_files import read_head_files
from inference_ref.head_spec import (
    CONFIG,
    HeadSpec,
    check_aux_layers,
    check_head_fits_target,
    resolve_class,
)
from inference_ref.models import TARGET_KINDS
from inference_ref.target import TargetModel

__all__ = ["Draft", "MTPDraft", "check_head_fits_target", "fuse_head_state", "load_draft"]


class MTPDraft(Draft):
    """The restored and eagle1 drafts: a decoder layer of the target's kind (eagle1's without its input norm)."""

    def build_layer(self, spec: HeadSpec) -> tuple[nn.Module, nn.Module, type]:
        layer, rotary, cache_type = TARGET_KINDS[spec.target.model_type].head_layer(spec.target, spec.mlp)
        if not spec.kind.math.layer_input_norm:
            layer.input_layernorm = nn.Identity()
        return layer, rotary, cache_type


def load_draft(path: str | Path, target: TargetModel) -> MTPDraft:
    """Load a native-format head directory for `target`, refusing one made for another shape."""
    path = Path(path)
    config, tensors = read_head_files(path)  # a native export, or an eagle3/vllm one renamed back
    spec = HeadSpec.from_config(config, f"{path / CONFIG}")
    check_head_fits_target(config, target.cfg)
    if spec.aux_layers:  # the layers it reads must be this target's
        check_aux_layers(spec.aux_layers, target.cfg.num_hidden_layers, f"{path / CONFIG}: aux_layers")
    for name, shared in config.get("shared_with_target", {}).items():
        if not shared and f"{name}.weight" not in tensors:
            raise ValueError(f"{path}: config.json says {name} is not shared, but head.safetensors lacks it")
    draft_class: type[Draft] = resolve_class(spec.kind.serving)  # the head kind's serving class
    return draft_class.from_tensors(spec, tensors, target)
