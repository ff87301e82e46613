"""A run resolved once per entry point: the target (directory, config, identity), the device and the
compute dtype. Every stage builds one `Run` from its config and passes it down, instead of resolving
the target again in each function it calls.

Paths that must agree between stages are linked in the config itself, by Hydra interpolation
(`train.store_dir` ← `precompute.store_dir`, `validate.head` / `export.checkpoint` ← the trained
head), so that overriding the first moves the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from inference_ref.head_spec import HEAD_KINDS, VARIANTS, HeadSpec, default_aux_layers
from inference_ref.target import TargetConfig, read_target_config
from mtp_train.parallel import Ranks, launched_processes, launched_ranks, one_group
from mtp_train.target_files import default_device, model_dtype, resolve_target, target_identity


@dataclass(frozen=True)
class Target:
    """The target of a run: where it is, its config, and the identity stores and heads record."""

    dir: Path
    config: TargetConfig
    identity: dict

    @classmethod
    def resolve(cls, spec: str) -> Target:
        """`model.target` (a directory, a `.gguf`, or the demo alias) → its directory, config and identity."""
        path = resolve_target(spec)
        config = read_target_config(path)
        return cls(path, config, target_identity(path, config))


@dataclass(frozen=True)
class Run:
    target: Target
    device: torch.device
    dtype: torch.dtype
    """Compute dtype of the target (and of validation's head)."""
    quantization: str = "none"
    """`model.quantization`: how the target's linear maps run."""
    ranks: Ranks | None = None
    """This process's place among the launched ones (None: launched alone)."""

    @property
    def tp_mesh(self):
        """The tensor-parallel group's DeviceMesh (`model.tp_size` > 1): the target is sharded over it."""
        return self.ranks.tp_mesh if self.ranks else None

    @property
    def main(self) -> bool:
        """Whether this process prints for the stage (the first rank of all, or launched alone)."""
        return self.ranks is None or self.ranks.main

    @property
    def leader(self) -> bool:
        """Whether this process writes the stage's outputs (its tensor-parallel group's first rank)."""
        return self.tp_mesh is None or self.tp_mesh.get_local_rank() == 0


def resolve_run(
    model,
    dtype: str | None = None,
    device: torch.device | None = None,
    sharded_as: str | None = None,
    data_parallel: bool = False,
) -> Run:
    """The run of `model` (the `model` config group) on `device` (default: CUDA if present) in
    `dtype` (a dtype name; default: `model.dtype`). `sharded_as`: the entry point (e.g.
    "mtp_train.validate") of a stage that runs the whole target: launched as several processes, it
    runs as tensor-parallel groups of `model.tp_size` processes, each on its own device, and as one
    such group unless the stage splits its work over groups (`data_parallel`)."""
    ranks = None
    if sharded_as and (model.tp_size > 1 or launched_processes() > 1):
        ranks = launched_ranks(model.tp_size, sharded_as)
        if not data_parallel:
            one_group(ranks, sharded_as)
        device = ranks.device
    device = device or default_device()
    dtype = model_dtype(dtype or model.dtype, device)
    return Run(Target.resolve(model.target), device, dtype, model.quantization, ranks)


def refuse_static_fp8(quantization: str, stage: str) -> None:
    """`model.quantization=fp8_static` is calibrated by precompute only (on its data's first 8,192 tokens);
    a stage that would load such a target uncalibrated says so at once, in one line."""
    if quantization == "fp8_static":
        raise ValueError(
            f"model.quantization=fp8_static: {stage} does not calibrate static FP8 input scales "
            "(precompute does, on its data's first 8,192 tokens): use model.quantization=fp8 here"
        )


def aux_layers_of(model, target: TargetConfig) -> tuple[int, ...]:
    """`model.aux_layers`, or the engines' default for this target's depth (what a store keeps
    with `precompute.aux`)."""
    if model.aux_layers is not None:
        return tuple(model.aux_layers)
    kind = HEAD_KINDS.get(model.variant)
    if kind is not None and kind.fuses_aux:
        return kind.aux_layers(None, target.num_hidden_layers, model.draft_layers)
    return default_aux_layers(target.num_hidden_layers)


def head_spec(model, target: TargetConfig, target_dir: Path) -> HeadSpec:
    """The head the `model` config group asks for on `target` (its kind's defaults where unset:
    the engines' aux layers, a draft vocabulary for a large target vocabulary, dflash's mask token
    from the tokenizer in `target_dir`)."""
    if model.variant not in HEAD_KINDS:
        raise ValueError(f"model.variant: {model.variant!r} is not one of {VARIANTS}")
    kind = HEAD_KINDS[model.variant]
    configured = None if model.aux_layers is None else tuple(model.aux_layers)
    aux = kind.aux_layers(configured, target.num_hidden_layers, model.draft_layers)
    vocab = model.draft_vocab_size
    if vocab is None:
        vocab = kind.default_draft_vocab(target.vocab_size)
    draft_vocab = 0 if vocab == target.vocab_size else vocab
    block = {}
    if kind.blocks:
        mask = model.mask_token_id
        block = dict(
            block_size=model.block_size,
            mask_token_id=mask_token(target_dir, target) if mask is None else mask,
        )
    return HeadSpec(
        model.variant, target, model.head_mlp, aux, draft_vocab, layers=model.draft_layers, **block
    )


def mask_token(target_dir: Path, target: TargetConfig) -> int:
    """A dflash head's mask token where `model.mask_token_id` is unset: the tokenizer's mask token,
    else the first embedding row no token uses, else pad, else EOS (SpecForge's and speculators'
    order; the embedding row is the target's, frozen, whichever it is)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    if tok.mask_token_id is not None:
        return tok.mask_token_id
    if len(tok) < target.vocab_size:
        return len(tok)
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
