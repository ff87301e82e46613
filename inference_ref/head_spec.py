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
eagle3.1 (EAGLE-3.1): eagle3 with each a_k normalized before fc (fc_norm), chained steps fed z, not y.
dflash (DFlash, block diffusion drafting; Llama-kind and Qwen3 targets):
    c = hidden_norm(fc([a_1; …; a_n]))   the context: one entry per committed position, the K/V
                                         of every draft layer made from it (no input norm)
    block [t_{i+1}, m, …, m] (the anchor and block_size − 1 mask tokens) at positions i+1 …:
    `layers` Qwen3-style layers, each query seeing the context ≤ i and the whole block;
    z = norm(y);  the mask at position i+1+j predicts t_{i+1+j}, all of them in one forward
eagle3 (EAGLE-3; Llama-kind targets):
    g = fc([a_1; …; a_n]) (the target's states entering the `aux_layers`, no bias; chained steps: g = y)
    y = g + attn([input_layernorm(embed(t_{i+1})); hidden_norm(g)]);  y += mlp(post_attention_layernorm(y))
    z = norm(y);  logits = lm_head_d(z) over the draft vocabulary (`d2t`: draft id → target id offset)
    `layers` > 1: y passes on through `later_layers`, Llama layers over H, before norm and chaining

`layer` is one decoder layer of the target's kind (`inference_ref.models.TARGET_KINDS`).

States handed to a head are the target's last-layer states, pre final norm, [.., H]; a target
asked to `capture` auxiliary layers widens them to [.., (1 + n)·H], the first H columns staying
the last layer's (`causal_lm.widened`). Every head reads the columns it needs.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inference_ref.causal_lm import RMSNorm
from inference_ref.models import TARGET_KINDS, Config, kind_of

FORMAT, FORMAT_VERSION = "mtp-train-head", 1
WEIGHTS, CONFIG = "head.safetensors", "config.json"

# The tensors a head shares with its target, under their native names: not stored by default.
SHARED = ("embed_tokens.weight", "lm_head.weight")


Symbolic = dict[str, tuple[str, ...]]
"""Tensor names → symbolic shapes ("H", "2H", …), resolved against a target's dimensions."""


class HeadMath:
    """A head kind's math on a module holding its tensors (the training head and the serving draft
    alike): the modules of its own besides the decoder layer, the layer's input, and the output state."""

    layer_input_norm = True
    """Whether its decoder layer keeps the layer's input_layernorm."""
    native_own: Symbolic = {}
    """Its own tensors in the native head.safetensors (the decoder layer's are `layer.*`)."""

    def own(self, spec: HeadSpec) -> dict[str, nn.Module]:
        """fc and the norms, in the order they are built (the random init draws in this order)."""
        raise NotImplementedError

    def native_names(self, spec: HeadSpec) -> Symbolic:
        """`native_own` for this spec (a kind with one tensor per auxiliary layer lists each)."""
        return self.native_own

    def project(self, head, e: torch.Tensor, state: torch.Tensor, final_norm: Callable, from_target: bool):
        """The layer's input from the next token's embedding `e` and `state`: the target's (maybe
        widened) pre-norm states (an entry made from the target) or the head's own y (a chained step)."""
        raise NotImplementedError

    def output_state(self, head, y: torch.Tensor) -> torch.Tensor:
        """z: the state whose logits are taken (and that training regresses to final_norm(h_{i+1}))."""
        return head.norm(y)


class RestoredMath(HeadMath):
    """e = enorm(embed(t_{i+1})); g = hnorm(h_i); x = fc([e; g]); z = norm(y)."""

    native_own = {
        "enorm.weight": ("H",),
        "hnorm.weight": ("H",),
        "fc.weight": ("H", "2H"),
        "layer.input_layernorm.weight": ("H",),
        "norm.weight": ("H",),
    }

    def own(self, spec):
        h, eps = spec.target.hidden_size, spec.target.rms_norm_eps
        norms = {name: RMSNorm(h, eps) for name in ("enorm", "hnorm", "norm")}
        return {**norms, "fc": nn.Linear(2 * h, h, bias=False)}

    def project(self, head, e, state, final_norm, from_target):
        if from_target:  # the last layer's state: the first H columns of widened states
            state = state[..., : head.spec.target.hidden_size]
        return head.fc(torch.cat([head.enorm(e), head.hnorm(state)], -1))


class Eagle1Math(HeadMath):
    """f = final_norm(h); x = fc([embed(t_{i+1}); f_i]) with bias; no input norm; z = y."""

    layer_input_norm = False
    native_own = {"fc.weight": ("H", "2H"), "fc.bias": ("H",)}

    def own(self, spec):
        h = spec.target.hidden_size
        return {"fc": nn.Linear(2 * h, h, bias=True)}

    def project(self, head, e, state, final_norm, from_target):
        # eagle1 reads features f = final_norm(h); its own y already lives in that space.
        f = final_norm(state) if from_target else state
        return head.fc(torch.cat([e, f], -1))

    def output_state(self, head, y):
        return y


class Eagle3Math(HeadMath):
    """g = fc([a_1; …; a_n]) (chained steps: g = y); the layer gets [e; g] and normalizes each half
    itself (input_layernorm, hidden_norm); z = norm(y)."""

    native_own = {"fc.weight": ("H", "nH"), "norm.weight": ("H",), "d2t": ("Vd",)}

    def own(self, spec):
        h = spec.target.hidden_size
        return {
            "fc": nn.Linear(len(spec.aux_layers) * h, h, bias=False),
            "norm": RMSNorm(h, spec.target.rms_norm_eps),
        }

    fc_norm = False
    """EAGLE-3.1: an RMSNorm on each auxiliary state before fc (vLLM's config `fc_norm`)."""
    norm_output = False
    """EAGLE-3.1: chained steps are fed norm(y), not y (vLLM's config `norm_output`)."""

    def project(self, head, e, state, final_norm, from_target):
        h = head.spec.target.hidden_size
        g = head.fc(state[..., h:]) if from_target else state
        return torch.cat([e, g], -1)


class Eagle31Math(Eagle3Math):
    """EAGLE-3.1 (vLLM 0.32 `llama_eagle3.py`: `fc_norm`, `norm_output`; the EAGLE authors, TorchSpec
    and vLLM, 2026-05): g = fc([fc_norm_1(a_1); …; fc_norm_n(a_n)]), each target state normalized by
    its own RMSNorm before the fusion; a chained step gets g = norm(y), the post-norm state whose
    logits were taken, instead of y. The rest is EAGLE-3's."""

    fc_norm = True
    norm_output = True

    def own(self, spec):
        h, eps = spec.target.hidden_size, spec.target.rms_norm_eps
        norms = nn.ModuleList([RMSNorm(h, eps) for _ in spec.aux_layers])
        return {**super().own(spec), "fc_norm": norms}

    def native_names(self, spec):
        return {**self.native_own, **{f"fc_norm.{i}.weight": ("H",) for i in range(len(spec.aux_layers))}}

    def project(self, head, e, state, final_norm, from_target):
        h = head.spec.target.hidden_size
        if from_target:
            parts = state[..., h:].split(h, dim=-1)
            g = head.fc(torch.cat([norm(a) for norm, a in zip(head.fc_norm, parts)], -1))
        else:
            g = head.norm(state)
        return torch.cat([e, g], -1)


class DFlashMath(HeadMath):
    """DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding"; vLLM 0.32
    `model_executor/models/qwen3_dflash.py` `DFlashQwen3Model`, `v1/spec_decode/dflash.py`; trained
    as SpecForge `specforge/modeling/draft/dflash.py` @ a6b6b02 and ModelOpt `hf_dflash.py` @ a2fbac7
    train it): the target's states at the `aux_layers` fused by fc and normalized by hidden_norm
    are the context, whose K/V each draft layer makes with its own k/v projections (k_norm and rope
    at the context position, no input_layernorm); the block's tokens run through the layers
    (input_layernorm, q/k norms: Qwen3's layer) attending to the context before the anchor and,
    without a causal mask, to the whole block; z = norm(y). No chained steps: `project` is unused."""

    native_own = {"fc.weight": ("H", "nH"), "hidden_norm.weight": ("H",), "norm.weight": ("H",)}

    def own(self, spec):
        h, eps = spec.target.hidden_size, spec.target.rms_norm_eps
        return {
            "fc": nn.Linear(len(spec.aux_layers) * h, h, bias=False),
            "hidden_norm": RMSNorm(h, eps),
            "norm": RMSNorm(h, eps),
        }

    def context(self, head, state: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(fc([a_1; …; a_n])) from widened target states [.., (1 + n)·H]."""
        return head.hidden_norm(head.fc(state[..., head.spec.target.hidden_size :]))

    def project(self, head, e, state, final_norm, from_target):
        raise TypeError("a dflash head drafts a block in one forward: it has no chained steps")


@dataclass(frozen=True)
class HeadKind:
    """One head kind: its math, where it is trained, served and exported, and the few facts the
    stages read of it. Adding a kind: its math here, a training and a serving module, one entry."""

    math: HeadMath
    training: str
    """`module:Class` of the training head (an `mtp_train.heads.base.DraftHead`)."""
    serving: str
    """`module:Class` of the serving draft (an `inference_ref.draft_base.Draft`)."""
    layouts: tuple[str, ...]
    """The export layouts that can hold it (`native` always; engine layouts where one exists)."""
    feature_loss: bool = True
    """Whether training regresses z to final_norm(h_{i+1}) (`train.w_h`); EAGLE-3 drops that term."""
    target_kinds: tuple[str, ...] | None = None
    """The target kinds it can be built for (None: every kind)."""
    fuses_aux: bool = False
    """Its first step fuses the target's auxiliary layers' states (EAGLE-3), not the last layer's."""
    blocks: bool = False
    """It drafts a whole block in one forward (DFlash) instead of chaining steps: `HeadSpec`'s
    `layers`, `block_size` and `mask_token_id` describe it."""
    stacks: bool = False
    """A chained kind that may stack Llama decoder layers after its first (`HeadSpec.layers` > 1):
    vLLM's `Eagle3LlamaForCausalLM` builds `num_hidden_layers`, the later ones reading H."""

    def aux_layers(
        self, configured: tuple[int, ...] | None, num_layers: int, draft_layers: int = 1
    ) -> tuple[int, ...]:
        """The target layers it reads besides the last: `configured`, or the engines' default."""
        if not self.fuses_aux:
            return ()
        if configured is not None:
            return tuple(configured)
        return dflash_aux_layers(num_layers, draft_layers) if self.blocks else default_aux_layers(num_layers)

    def default_draft_vocab(self, vocab_size: int) -> int:
        """A draft vocabulary where none is configured: EAGLE-3's 32k for a large vocabulary."""
        return DRAFT_VOCAB if self.fuses_aux and vocab_size >= 100_000 else 0

    @property
    def always_d2t(self) -> bool:
        """Whether its native file holds d2t even for the whole vocabulary (the engines' EAGLE-3 files do)."""
        return self.fuses_aux and not self.blocks


# EAGLE-3's draft vocabulary where the target's is large (Llama-3's 128k): 32,000 tokens, the size of
# the EAGLE reference's and SpecForge's Llama-3 heads.
DRAFT_VOCAB = 32_000

HEAD_KINDS: dict[str, HeadKind] = {
    "rmsnorm-restored": HeadKind(
        math=RestoredMath(),
        training="mtp_train.heads.mtp:MTPHead",
        serving="inference_ref.draft:MTPDraft",
        layouts=("native", "deepseek_mtp", "vllm"),
    ),
    "eagle1": HeadKind(
        math=Eagle1Math(),
        training="mtp_train.heads.mtp:MTPHead",
        serving="inference_ref.draft:MTPDraft",
        layouts=("native", "eagle1", "vllm"),
    ),
    "eagle3": HeadKind(
        math=Eagle3Math(),
        training="mtp_train.heads.eagle3:Eagle3Head",
        serving="inference_ref.eagle3:Eagle3Draft",
        layouts=("native", "eagle3", "speculators", "vllm"),
        feature_loss=False,
        target_kinds=("llama", "qwen3"),  # engines serve both with a Llama draft layer
        fuses_aux=True,
        stacks=True,
    ),
    "eagle3.1": HeadKind(
        math=Eagle31Math(),
        training="mtp_train.heads.eagle3:Eagle3Head",
        serving="inference_ref.eagle3:Eagle3Draft",
        # vLLM reads fc_norm / norm_output; SGLang's and TensorRT-LLM's EAGLE-3 loaders would drop them
        layouts=("native", "vllm"),
        feature_loss=False,
        target_kinds=("llama", "qwen3"),
        fuses_aux=True,
        stacks=True,
    ),
    "dflash": HeadKind(
        math=DFlashMath(),
        training="mtp_train.heads.dflash:DFlashHead",
        serving="inference_ref.dflash:DFlashDraft",
        layouts=("native", "vllm"),  # vLLM's DFlashDraftModel
        feature_loss=False,
        target_kinds=("llama", "qwen3"),  # targets whose vLLM class hands out auxiliary states
        fuses_aux=True,
        blocks=True,
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
    layers: int = 1
    """Decoder layers (`model.draft_layers`): dflash's, or a stacking kind's (eagle3, eagle3.1: the
    first reads [e; g], the later ones are Llama layers chained after it); the other kinds have one."""
    block_size: int = 0
    """dflash: tokens per drafted block, the anchor and block_size − 1 masks (it drafts up to
    block_size − 1 tokens per verify); 0 for the chained kinds."""
    mask_token_id: int = 0
    """dflash: the token fed at the masked block positions (its frozen target embedding)."""

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
        if self.kind.fuses_aux:
            check_aux_layers(self.aux_layers, self.target.num_hidden_layers, "model.aux_layers")
        self.check_block()
        if not 0 <= self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(
                f"model.draft_vocab_size: {self.draft_vocab_size} is not in 0 … {self.target.vocab_size}"
            )

    def check_block(self) -> None:
        if not self.kind.blocks:
            if self.block_size != 0:
                raise ValueError(
                    f"block_size={self.block_size}: a {self.variant} head chains its steps; blocks are dflash's"
                )
            if self.layers < 1 or (self.layers > 1 and not self.kind.stacks):
                raise ValueError(
                    f"model.draft_layers={self.layers}: a {self.variant} head chains the steps of one "
                    "decoder layer (eagle3 and eagle3.1 heads may stack more)"
                )
            return
        if self.layers < 1 or self.block_size < 2:
            raise ValueError(
                f"model.draft_layers={self.layers}, model.block_size={self.block_size}: a dflash head "
                "needs ≥ 1 layer and a block of ≥ 2 tokens (the anchor and a mask)"
            )
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ValueError(
                f"model.mask_token_id: {self.mask_token_id} is not a token id of this target "
                f"(0 … {self.target.vocab_size - 1})"
            )

    @property
    def vocab(self) -> int:
        """Rows of the head's lm_head: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.target.vocab_size

    @property
    def kind(self) -> HeadKind:
        return HEAD_KINDS[self.variant]

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
            **({"aux_layers": list(self.aux_layers)} if self.kind.fuses_aux else {}),
            **({"draft_vocab_size": self.vocab} if self.kind.always_d2t or self.draft_vocab_size else {}),
            **(
                {"layers": self.layers, "block_size": self.block_size, "mask_token_id": self.mask_token_id}
                if self.kind.blocks
                else {}
            ),
            **({"layers": self.layers} if self.layers > 1 and not self.kind.blocks else {}),
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
        block = {k: config[k] for k in ("layers", "block_size", "mask_token_id") if k in config}
        return cls(config["variant"], target, mlp, tuple(config.get("aux_layers", ())), draft_vocab, **block)


def read_json(path: str | Path) -> dict:
    """A config file, or one line naming it: missing, or not valid JSON (and where)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a {type(config).__name__}, not a JSON object")
    return config


def require_keys(config: dict, keys: tuple[str, ...], where: str) -> None:
    """One line naming the fields a config lacks (instead of a KeyError where one is first read)."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")


def architecture(model_type: str) -> str:
    """The head's architecture name for a target kind (`LlamaMTPHead`, `DeepseekV2MTPHead`)."""
    return TARGET_KINDS[model_type].config.__name__.removesuffix("Config") + "MTPHead"


def check_mlp(mlp: str, kind: str, field: str) -> None:
    """The head layer's MLP option, checked alike where a head is trained (`model.head_mlp`) and
    where it is served (config.json's `mlp`): `moe` needs a target kind whose layers have experts."""
    options = TARGET_KINDS[kind].head_mlps
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


def dflash_aux_layers(num_layers: int, draft_layers: int) -> tuple[int, ...]:
    """DFlash's target layers where none are configured, as z-lab/dflash, SpecForge and ModelOpt
    pick them (`build_target_layer_ids`): the middle layer for one draft layer, else `draft_layers`
    spread evenly over 1 … L − 3. Their ids are layer outputs; here the states entering the next
    layer (vLLM adds the same 1: `get_eagle3_aux_layers_from_config`)."""
    if draft_layers == 1:
        return (num_layers // 2 + 1,)
    start, end = 1, num_layers - 3
    return tuple(round(start + i * (end - start) / (draft_layers - 1)) + 1 for i in range(draft_layers))


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


def resolve_class(path: str) -> type:
    """The class a registry entry names as `module:Class` (imported on first use: the training
    classes live in mtp_train, which inference_ref never imports at module level)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
