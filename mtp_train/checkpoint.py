"""Training checkpoints for exact resume: head, optimizer, scheduler, data position, RNG.

Without DeepSpeed everything is safetensors + JSON (nothing is unpickled on resume). Under
DeepSpeed the engine owns the (ZeRO-sharded) optimizer state, so accelerate's `save_state`
writes DeepSpeed's own per-rank format. A checkpoint directory becomes visible only when complete
(written under a temporary name, then renamed), so a killed run resumes from the last whole one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

PREFIX = "ckpt-"


def latest(out_dir: Path) -> Path | None:
    done = sorted(p for p in out_dir.glob(f"{PREFIX}*") if (p / "state.json").exists())
    return done[-1] if done else None


def _deepspeed(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.DEEPSPEED


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flatten the optimizer's per-parameter tensors to names; the rest goes to JSON."""
    sd = optimizer.state_dict()
    tensors = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"state.{pid}.{key}"] = value.detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def _restore_optimizer(optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save(acc: Accelerator, out_dir: Path, step: int, head, optimizer, scheduler, keep: int = 2) -> Path:
    final = out_dir / f"{PREFIX}{step:07d}"
    tmp = out_dir / f".tmp-{PREFIX}{step:07d}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    if _deepspeed(acc):
        acc.save_state(str(tmp))
    elif acc.is_main_process:
        tmp.mkdir(parents=True)
        save_file(_named_params(acc.unwrap_model(head)), str(tmp / "model.safetensors"))
        tensors, meta = _optimizer_tensors(optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(meta))
    acc.wait_for_everyone()
    if acc.is_main_process:
        state = {"step": step, "scheduler": scheduler.state_dict()}
        (tmp / "state.json").write_text(json.dumps(state))
        tmp.rename(final)
        for old in sorted(out_dir.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def load(acc: Accelerator, ckpt: Path, head, optimizer, scheduler) -> int:
    """Restore everything from `ckpt`; returns the step to continue from."""
    state = json.loads((ckpt / "state.json").read_text())
    if _deepspeed(acc):
        acc.load_state(str(ckpt))
    else:
        model = acc.unwrap_model(head)
        params = load_file(str(ckpt / "model.safetensors"))
        model.load_state_dict(params, strict=True)
        tensors = load_file(str(ckpt / "optimizer.safetensors"))
        torch.set_rng_state(tensors.pop("rng.torch"))
        _restore_optimizer(optimizer, tensors, json.loads((ckpt / "optimizer.json").read_text()))
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def _named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (an eagle3 head's d2t): what `load_state_dict` restores."""
    return {n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()}
