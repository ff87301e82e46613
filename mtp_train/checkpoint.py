"""Training checkpoints for exact resume: head, optimizer, scheduler, data position, RNG.

Without DeepSpeed everything is safetensors + JSON (nothing is unpickled on resume). Under
DeepSpeed the engine owns the (ZeRO-sharded) optimizer state, so accelerate's `save_state`
writes DeepSpeed's own per-rank format. A checkpoint directory becomes visible only when complete
(written under a temporary name, then renamed), so a killed run resumes from the last whole one.

`state.json` records the sha256 of every file of the checkpoint and what the run was made with
(the target, the store, the micro-batch plan): resuming takes the newest checkpoint whose files
hash right (saying which it skipped and why) and refuses one made with another target, store or plan.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

from mtp_train.store import file_sha256

PREFIX = "ckpt-"


def latest(out_dir: Path, identity: dict | None = None, say: Callable[[str], None] = print) -> Path | None:
    """The newest intact checkpoint in `out_dir` (None if there is none). A damaged one is skipped,
    saying so; one made with another target, store or plan (`identity`) is refused."""
    for ckpt in sorted(out_dir.glob(f"{PREFIX}*"), reverse=True):
        say(f"checkpoint {ckpt}: checking its files against their sha256 before resuming")
        problem = damage(ckpt)
        if problem:
            say(f"checkpoint {ckpt} is damaged ({problem}); falling back to the one before it")
            continue
        if identity is not None:
            check_identity(ckpt, identity)
        return ckpt
    return None


def damage(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint directory, or None: `state.json` readable and matching its
    own sha256, every file it lists present with its sha256 (checkpoints written before the hashes
    are taken as they are)."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json unreadable: {type(e).__name__}"
    if "sha256" in state and state_sha256(state) != state["sha256"]:
        return "state.json does not match its sha256 (edited?)"
    for name, sha in state.get("files", {}).items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != sha:
            return f"{name} does not match its sha256"
    return None


def state_sha256(state: dict) -> str:
    """The hash of a checkpoint's state.json content, itself left out."""
    body = json.dumps({k: v for k, v in state.items() if k != "sha256"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def check_identity(ckpt: Path, identity: dict) -> None:
    made_with = json.loads((ckpt / "state.json").read_text()).get("identity")
    if made_with is None:
        return  # written before checkpoints recorded it
    for part in ("target", "store", "plan", "head"):
        if part in made_with and made_with.get(part) != identity.get(part):
            raise ValueError(
                f"checkpoint {ckpt} was made with another {part} ({made_with.get(part)}; this run: "
                f"{identity.get(part)}): an exact resume needs the same one. Use another train.out_dir, "
                "or train.resume=false to start over"
            )


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


def save(
    acc: Accelerator,
    out_dir: Path,
    step: int,
    head,
    optimizer,
    scheduler,
    identity: dict,
    settings: dict | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` (`settings`: the training settings it was made with, which a resume
    compares with its own)."""
    final = out_dir / f"{PREFIX}{step:07d}"
    tmp = out_dir / f".tmp-{PREFIX}{step:07d}"
    acc.print(f"step {step}: writing checkpoint {final} (then hashing its files)")
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
        files = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        state = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "files": files,
            "identity": identity,
            "settings": settings or {},
        }
        state["sha256"] = state_sha256(state)
        (tmp / "state.json").write_text(json.dumps(state))  # last: it makes the checkpoint whole
        if final.exists():  # a rerun reaching the same step, or a damaged leftover: replaced
            shutil.rmtree(final)
        tmp.rename(final)
        for old in sorted(out_dir.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def saved_settings(ckpt: Path) -> dict:
    return json.loads((ckpt / "state.json").read_text()).get("settings", {})


def load(acc: Accelerator, ckpt: Path, head, optimizer, scheduler) -> int:
    """Restore everything from `ckpt`; returns the step to continue from."""
    state = json.loads((ckpt / "state.json").read_text())
    if _deepspeed(acc):
        with weights_only_loads():
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


@contextmanager
def weights_only_loads():
    """Every `torch.load` inside as `weights_only=True`: DeepSpeed's checkpoint engine asks for
    `weights_only=False`, with which a crafted checkpoint runs code on resume. Only the DeepSpeed
    classes its ZeRO checkpoints hold (loss scaler, stage enum, fragment addresses) are allowed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    original = torch.load

    def load(*args, **kwargs):
        return original(*args, **{**kwargs, "weights_only": True})

    torch.load = load
    try:
        with torch.serialization.safe_globals(
            [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
        ):
            yield
    finally:
        torch.load = original


def _named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (an eagle3 head's d2t): what `load_state_dict` restores."""
    return {n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()}
