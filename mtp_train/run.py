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

from inference_ref.target import TargetConfig, read_target_config
from mtp_train.targets import default_device, model_dtype, resolve_target, target_identity


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


def resolve_run(model, dtype: str | None = None, device: torch.device | None = None) -> Run:
    """The run of `model` (the `model` config group) on `device` (default: CUDA if present) in
    `dtype` (a dtype name; default: `model.dtype`)."""
    device = device or default_device()
    return Run(Target.resolve(model.target), device, model_dtype(dtype or model.dtype, device))
