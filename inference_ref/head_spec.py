"""The one description of a draft head, read alike by training (`mtp_train.heads`), serving
(`inference_ref.draft`) and export (`mtp_train.export`): the spec, the head kinds, the native
format's constants, the tensors shared with the target, and the projection and output math.

Head kinds (`HEAD_KINDS`, keyed by `model.variant`):

rmsnorm-restored (default):
    e = enorm(embed(t_{i+1}));  g = hnorm(h_i);  x = fc([e; g])
    y = layer(x);  z = norm(y);  logits = lm_head(z)          (y feeds chained steps)
eagle1 (ablation, the EAGLE paper's head):
    f = final_norm(h);  x = fc([embed(t_{i+1}); f_i]) with bias
    y = layer(x) without input_layernorm;  z = y;  logits = lm_head(y)

`layer` is one decoder layer of the target's kind (`inference_ref.models.KINDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from inference_ref.models import KINDS, Config, kind_of

FORMAT, FORMAT_VERSION = "mtp-train-head", 1
WEIGHTS, CONFIG = "head.safetensors", "config.json"

# The tensors a head shares with its target, under their native names: not stored by default.
SHARED = ("embed_tokens.weight", "lm_head.weight")


class HeadKind(NamedTuple):
    """One head kind: its structure, and where it is trained, served and exported."""

    restored_norms: bool
    """enorm / hnorm on the inputs, the layer's input_layernorm and a final norm (else none of them)."""
    fc_bias: bool
    """Whether `fc` has a bias."""
    training: str
    """The module that trains it."""
    serving: str
    """The module that serves it."""
    layouts: tuple[str, ...]
    """The export layouts that can hold it (`native` always; engine layouts where one exists)."""


HEAD_KINDS: dict[str, HeadKind] = {
    "rmsnorm-restored": HeadKind(
        True, False, "mtp_train.heads", "inference_ref.draft", ("native", "deepseek_mtp")
    ),
    "eagle1": HeadKind(False, True, "mtp_train.heads", "inference_ref.draft", ("native", "eagle1")),
}
VARIANTS = tuple(HEAD_KINDS)


@dataclass(frozen=True)
class HeadSpec:
    """A head's shape: what training builds, the native config.json records and serving rebuilds."""

    variant: str
    """The head kind: a key of `HEAD_KINDS`."""
    target: Config
    """The target's config: the head's layer is one layer of this shape and kind."""
    mlp: str = "dense"
    """The layer's MLP: `dense`, or `moe` (the target's MoE block, for kinds whose layers have experts)."""

    def __post_init__(self):
        if self.variant not in HEAD_KINDS:
            raise ValueError(f"model.variant: {self.variant!r} is not one of {VARIANTS}")
        check_mlp(self.mlp, self.target.model_type, "model.head_mlp")

    @property
    def kind(self) -> HeadKind:
        return HEAD_KINDS[self.variant]

    @property
    def restored(self) -> bool:
        return self.kind.restored_norms

    @property
    def architecture(self) -> str:
        """config.json's `architecture`: the target kind's head class name."""
        return architecture(self.target.model_type)

    def to_config(self) -> dict:
        """The shape part of the native config.json."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "architecture": self.architecture,
            "variant": self.variant,
            "mlp": self.mlp,
            "hidden_size": self.target.hidden_size,
            "vocab_size": self.target.vocab_size,
            "layer_config": self.target.to_hf(),
        }

    @classmethod
    def from_config(cls, config: dict, where: str = "head config.json") -> HeadSpec:
        """Read back `to_config`'s fields (a config.json without "mlp", from before the MoE option, is dense)."""
        if (config.get("format"), config.get("format_version")) != (FORMAT, FORMAT_VERSION):
            raise ValueError(
                f"{where}: format {config.get('format')!r} version {config.get('format_version')!r}"
                f" is not {FORMAT!r} version {FORMAT_VERSION}"
            )
        target = kind_of(config["layer_config"].get("model_type"), where).config.from_hf(
            config["layer_config"]
        )
        expected = architecture(target.model_type)
        if config.get("architecture") != expected or config.get("variant") not in HEAD_KINDS:
            raise ValueError(
                f"{where}: architecture {config.get('architecture')!r} variant "
                f"{config.get('variant')!r} is not {expected!r} with a variant in {VARIANTS}"
            )
        mlp = config.get("mlp", "dense")
        check_mlp(mlp, target.model_type, f"{where}: mlp")
        return cls(config["variant"], target, mlp)


def architecture(model_type: str) -> str:
    """The head's architecture name for a target kind (`LlamaMTPHead`, `DeepseekV2MTPHead`)."""
    return KINDS[model_type].config.__name__.removesuffix("Config") + "MTPHead"


def check_mlp(mlp: str, kind: str, field: str) -> None:
    """The head layer's MLP option, checked alike where a head is trained (`model.head_mlp`) and
    where it is served (config.json's `mlp`): `moe` needs a target kind whose layers have experts."""
    options = KINDS[kind].head_mlps
    if mlp not in ("dense", "moe"):
        raise ValueError(f"{field}: {mlp!r} is not one of ('dense', 'moe')")
    if mlp not in options:
        raise ValueError(
            f"{field}: {mlp!r} builds the target's MoE block, but this target is {kind}, "
            f"whose layers have no experts: use one of {options}"
        )


def check_head_fits_target(config: dict, target: Config, where: str = "head") -> None:
    """A head reads the target's hidden states and proposes the target's token ids, with a layer of
    the target's kind: kind and sizes must match (checked before anything large is loaded)."""
    kind = config["layer_config"].get("model_type")
    if kind != target.model_type:
        raise ValueError(
            f"{where} is a {config.get('architecture')} for a {kind} target, this target is "
            f"{target.model_type}: it was trained for another kind of target"
        )
    for key in ("hidden_size", "vocab_size"):
        if config[key] != getattr(target, key):
            raise ValueError(
                f"{where} has {key} {config[key]}, this target has {getattr(target, key)}: "
                "it was trained for another target"
            )


# ------------------------------------------------------------------------------------ the head's math
# Training and serving modules both have `spec`, `fc` and, when restored, `enorm`, `hnorm`, `norm`.


def project(
    head, e: torch.Tensor, state: torch.Tensor, final_norm: Callable, from_target: bool
) -> torch.Tensor:
    """fc's output from the next token's embedding `e` and `state`: the target's pre-norm h (an
    entry made from the target) or the head's own y (a chained step)."""
    if head.spec.restored:
        return head.fc(torch.cat([head.enorm(e), head.hnorm(state)], -1))
    # eagle1 reads features f = final_norm(h); its own y already lives in that space.
    f = final_norm(state) if from_target else state
    return head.fc(torch.cat([e, f], -1))


def output_state(head, y: torch.Tensor) -> torch.Tensor:
    """z: the state whose logits are taken (and that training regresses to final_norm(h_{i+1}))."""
    return head.norm(y) if head.spec.restored else y
