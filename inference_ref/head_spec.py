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
eagle3 (EAGLE-3; Llama-kind targets):
    g = fc([a_1; …; a_n]) (the target's states entering the `aux_layers`, no bias; chained steps: g = y)
    y = g + attn([input_layernorm(embed(t_{i+1})); hidden_norm(g)]);  y += mlp(post_attention_layernorm(y))
    z = norm(y);  logits = lm_head_d(z) over the draft vocabulary (`d2t`: draft id → target id offset)

`layer` is one decoder layer of the target's kind (`inference_ref.models.KINDS`).

States handed to a head are the target's last-layer states, pre final norm, [.., H]; a target
asked to `capture` auxiliary layers widens them to [.., (1 + n)·H], the first H columns staying
the last layer's (`causal_lm.widened`). Every head reads the columns it needs.
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
    reads_aux: bool
    """Its first step reads the target's auxiliary layers' states (EAGLE-3), not the last layer's."""
    feature_loss: bool
    """Whether training regresses z to final_norm(h_{i+1}) (`train.w_h`); EAGLE-3 drops that term."""
    target_kinds: tuple[str, ...] | None
    """The target kinds it can be built for (None: every kind)."""
    training: str
    """The module that trains it."""
    serving: str
    """The module that serves it."""
    layouts: tuple[str, ...]
    """The export layouts that can hold it (`native` always; engine layouts where one exists)."""


HEAD_KINDS: dict[str, HeadKind] = {
    "rmsnorm-restored": HeadKind(
        restored_norms=True,
        fc_bias=False,
        reads_aux=False,
        feature_loss=True,
        target_kinds=None,
        training="mtp_train.heads.mtp",
        serving="inference_ref.draft",
        layouts=("native", "deepseek_mtp"),
    ),
    "eagle1": HeadKind(
        restored_norms=False,
        fc_bias=True,
        reads_aux=False,
        feature_loss=True,
        target_kinds=None,
        training="mtp_train.heads.mtp",
        serving="inference_ref.draft",
        layouts=("native", "eagle1"),
    ),
    "eagle3": HeadKind(
        restored_norms=True,
        fc_bias=False,
        reads_aux=True,
        feature_loss=False,
        target_kinds=("llama", "qwen3"),  # engines serve both with a Llama draft layer
        training="mtp_train.heads.eagle3",
        serving="inference_ref.eagle3",
        layouts=("native", "eagle3", "speculators"),
    ),
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
    aux_layers: tuple[int, ...] = ()
    """eagle3: the target layers whose entering states `fc` fuses (`causal_lm.widened` numbering)."""
    draft_vocab_size: int = 0
    """Rows of its lm_head, the most frequent target tokens (0: the whole target vocabulary). The
    draft scores only these: its lm_head work and the training loss's vocabulary work shrink by
    vocab / draft_vocab_size (EAGLE-3's draft vocabulary; FR-Spec's frequency-ranked one)."""

    def __post_init__(self):
        if self.variant not in HEAD_KINDS:
            raise ValueError(f"model.variant: {self.variant!r} is not one of {VARIANTS}")
        kinds = self.kind.target_kinds
        if kinds is not None and self.target.model_type not in kinds:
            raise ValueError(
                f"model.variant: {self.variant} heads are built for {kinds} targets (the engines' "
                f"EAGLE-3 loaders), this target is {self.target.model_type}"
            )
        check_mlp(self.mlp, self.target.model_type, "model.head_mlp")
        if self.kind.reads_aux:
            check_aux_layers(self.aux_layers, self.target.num_hidden_layers, "model.aux_layers")
        if not 0 <= self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(
                f"model.draft_vocab_size: {self.draft_vocab_size} is not in 0 … {self.target.vocab_size}"
            )

    @property
    def vocab(self) -> int:
        """Rows of the head's lm_head: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.target.vocab_size

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
            **({"aux_layers": list(self.aux_layers)} if self.kind.reads_aux else {}),
            **({"draft_vocab_size": self.vocab} if self.kind.reads_aux or self.draft_vocab_size else {}),
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
        vocab = config.get("draft_vocab_size", target.vocab_size)
        draft_vocab = 0 if vocab == target.vocab_size else vocab
        return cls(config["variant"], target, mlp, tuple(config.get("aux_layers", ())), draft_vocab)


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


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of each draft-vocabulary row from the engines' offsets: draft id + d2t[draft id]."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's auxiliary layers where none are configured: the states entering layers 2, L/2 and
    L − 3, as vLLM (`get_eagle3_aux_hidden_state_layers` in vllm/model_executor/models/llama.py) and
    the EAGLE reference capture them (docs/export.md cites the commits)."""
    return (2, num_layers // 2, num_layers - 3)


def check_aux_layers(layers: tuple[int, ...], num_layers: int, field: str) -> None:
    # Entering-layer ids below L: vLLM captures a state before running layer idx < L, so L is none.
    if not layers or list(layers) != sorted(set(layers)) or not all(0 <= k < num_layers for k in layers):
        raise ValueError(
            f"{field}: {list(layers)} must be increasing distinct layer ids in 0 … {num_layers - 1} "
            "(the states entering those layers; the default is 2, L/2, L − 3)"
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
    """The layer's input from the next token's embedding `e` and `state`: the target's (maybe
    widened) pre-norm states (an entry made from the target) or the head's own y (a chained step)."""
    h = head.spec.target.hidden_size
    if head.spec.kind.reads_aux:
        # EAGLE-3: the layer gets [e; g] and normalizes each half itself (input_layernorm, hidden_norm).
        g = head.fc(state[..., h:]) if from_target else state
        return torch.cat([e, g], -1)
    if from_target:
        state = state[..., :h]
    if head.spec.restored:
        return head.fc(torch.cat([head.enorm(e), head.hnorm(state)], -1))
    # eagle1 reads features f = final_norm(h); its own y already lives in that space.
    f = final_norm(state) if from_target else state
    return head.fc(torch.cat([e, f], -1))


def output_state(head, y: torch.Tensor) -> torch.Tensor:
    """z: the state whose logits are taken (and that training regresses to final_norm(h_{i+1}))."""
    return head.norm(y) if head.spec.restored else y
