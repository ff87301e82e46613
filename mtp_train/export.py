"""Write a trained head in the native format (and engine layouts), and read it back for training.

Native format, one directory (the contract inference_ref/draft.py reads; docs/export.md has the spec):
    head.safetensors   the head's own tensors under DraftHead's state_dict names
                       (+ embed_tokens.weight, lm_head.weight when stored rather than shared)
    config.json        format, version, architecture, variant, mlp, dtype, sizes, the target's layer
                       config, what is shared with the target, the target's identity, training metadata

    python -m mtp_train.export model=llama3_1_8b export.formats=[native]      # + eagle1 for model.variant=eagle1

Every directory is written under a temporary name and renamed when complete, so a killed export
leaves either the previous head or none, never half of one.
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from mtp_train.cli import answer_help_first

answer_help_first(__name__, __file__)  # before torch & co.: they take seconds to import

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import hydra
import torch
from safetensors.torch import save_file

from inference_ref.head_files import (
    ENGINE_WEIGHTS,
    NATIVE_CONFIG,
    read_head_files,
    read_native_config,
    weights_file,
)
from inference_ref.head_spec import (
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    WEIGHTS,
    HeadSpec,
    check_head_fits_target,
    draft_ids,
    require_keys,
)
from inference_ref.target import TargetConfig, frozen_target_tensors
from mtp_train.cli import one_line_errors
from mtp_train.config import checked  # also registers the schema Hydra composes
from mtp_train.heads import DraftHead, build, head_class
from mtp_train.layer_names import Symbolic, check_layout, resolve
from mtp_train.run import Target
from mtp_train.serving.layouts import HOLD_SHARED, LAYOUTS, LayoutUnsupported
from mtp_train.target_files import check_same_target

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Native names of the shared tensors (`head_spec.SHARED`) → the DraftHead buffers that hold the target's copies.
SHARED_BUFFERS = {"embed_tokens.weight": "embed_weight", "lm_head.weight": "lm_head_weight"}

# The native table: exactly the training head's state_dict: its kind's own tensors (`HeadKind.math.native_names`),
# its decoder layer under `layer.` (the head class's `native_block`), the shared ones where stored.
NATIVE_SHARED: Symbolic = {"embed_tokens.weight": ("V", "H"), "lm_head.weight": ("Vd", "H")}


def native_table(spec: HeadSpec, store_shared: bool) -> dict[str, tuple[int, ...]]:
    """The native head.safetensors' names and shapes: the kind's own tensors, its decoder layer
    under `layer.` (a stacking kind's later layers under `later_layers.<i>.`), the shared ones
    where stored."""
    block, dims = head_class(spec).native_block(spec)
    later = head_class(spec).native_later_block(spec)
    dims = {**dims, "Vd": spec.vocab, "nH": len(spec.aux_layers) * spec.target.hidden_size}
    vocabulary = {"d2t": ("Vd",)} if spec.draft_vocab_size else {}
    symbolic = {
        **spec.kind.math.native_names(spec),
        **vocabulary,
        **{f"layer.{name}": shape for name, shape in block.items()},
        **{
            f"later_layers.{i}.{name}": shape for i in range(spec.layers - 1) for name, shape in later.items()
        },
        **(NATIVE_SHARED if store_shared else {}),
    }
    return resolve(symbolic, dims)


# ---------------------------------------------------------------------------------------------- write


def head_tensors(
    head: DraftHead,
    dtype: torch.dtype,
    store_shared: bool,
    params: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The head's tensors under native names, cast to `dtype`, on CPU.

    `params` replaces the module's own state dict where that is sharded (ZeRO-3 gathers a full copy).
    """
    own = head.state_dict()
    if params is not None:
        if set(params) != set(own):
            raise ValueError(f"save_head: params names {sorted(params)} differ from the head's {sorted(own)}")
        own = params
    tensors = dict(own)
    if store_shared:
        # Cloned: a tied target's embedding and lm_head are one tensor, which safetensors refuses twice.
        tensors.update({name: getattr(head, buffer).clone() for name, buffer in SHARED_BUFFERS.items()})
    check_finite_tensors(tensors, "the head")
    # Integer tensors (eagle3's d2t) keep their dtype.
    return {
        n: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        for n, t in tensors.items()
    }


def check_finite_tensors(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse to write (or read back) a head with a NaN or inf in it, naming the first such tensor."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"{what}: {name} has {bad} non-finite values of {t.numel()}; refusing to export it"
            )


def head_config(
    head: DraftHead, identity: dict, training: dict, dtype: torch.dtype, store_shared: bool
) -> dict:
    return {
        **head.spec.to_config(),
        "dtype": str(dtype).removeprefix("torch."),
        "shared_with_target": {"embed_tokens": not store_shared, "lm_head": not store_shared},
        "target": identity,
        "training": training,
    }


NATIVE_FIELDS = ("variant", "architecture", "layer_config", "hidden_size", "vocab_size", "target", "training")
"""What reading a native head needs of its config (head_config writes them)."""


def save_head(
    head: DraftHead,
    out_dir: str | Path,
    target_identity: dict,
    training: dict,
    dtype: torch.dtype = torch.bfloat16,
    store_shared: bool = False,
    params: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `head` in the native format to `out_dir` (replacing what is there, atomically)."""
    tensors = head_tensors(head, dtype, store_shared, params)
    check_layout(tensors, native_table(head.spec, store_shared), f"native {head.spec.variant} head")
    config = head_config(head, target_identity, training, dtype, store_shared)
    return write_atomically(Path(out_dir), lambda d: write_files(d, tensors, config))


def write_files(
    directory: Path, tensors: dict[str, torch.Tensor], config: dict, weights: str = WEIGHTS
) -> None:
    save_file(tensors, str(directory / weights), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def write_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Fill a fresh sibling directory with `write`, then rename it to `out_dir`.

    A directory cannot be renamed over a non-empty one, so an existing `out_dir` is first moved
    aside and deleted after the swap: readers see the old head or the new one, never a partial one.
    """
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        write(tmp)
        _as_umask_allows(tmp)
        _sync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out_dir.parent / f".{out_dir.name}.tmp-old-{tag}"
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _check_replaceable(out_dir: Path) -> None:
    """Only an export directory is replaced: a mistyped out_dir must not delete someone's data."""
    ours = {WEIGHTS, ENGINE_WEIGHTS, CONFIG}
    if out_dir.exists() and not (out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= ours):
        raise FileExistsError(f"{out_dir} exists and is not an exported head; refusing to replace it")


def _as_umask_allows(directory: Path) -> None:
    """Give the files the mode a plain open() would (safetensors writes its file 0600): a serving
    engine often runs as another user than the one who exported the head."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _sync(directory: Path) -> None:
    """Flush the files to disk before the rename publishes them (a crash must not publish zeros)."""
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


# ----------------------------------------------------------------------------------------------- read


def read_head_config(head_dir: str | Path) -> dict:
    """The native config of a head directory (a native export, or the one an eagle3/vllm export
    carries under `mtp_train_head`), checked to be this format."""
    path = Path(head_dir) / CONFIG
    config = read_native_config(head_dir)
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {config.get('format')!r} v{config.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    require_keys(config, NATIVE_FIELDS, f"{path} (the head's native config)")
    return config


def check_head_matches_target(config: dict, head_dir: Path, target: TargetConfig, identity: dict) -> None:
    """Refuse a head made for another target: kind and sizes first (the clearest messages), then identity."""
    check_head_fits_target(config, target, f"head {head_dir}")
    trained_for = config["target"].get("path")
    check_same_target(identity, config["target"], f"head {head_dir} (trained for {trained_for})")


def load_head(head_dir: str | Path, target: Target | str | Path) -> DraftHead:
    """Rebuild a trainable DraftHead from a native head directory on the target it was trained for
    (a resolved `Target`, or a target directory)."""
    target = target if isinstance(target, Target) else Target.resolve(str(target))
    head_dir = Path(head_dir)
    config = read_head_config(head_dir)
    check_head_matches_target(config, head_dir, target.config, target.identity)
    spec = HeadSpec.from_config(config, f"{head_dir / CONFIG}")
    _, tensors = read_head_files(head_dir)
    for name in SHARED_BUFFERS:  # stored copies of the target's own tensors: the target's are used
        tensors.pop(name, None)
    where = f"{weights_file(head_dir)} (read under native names)"
    check_layout(tensors, native_table(spec, False), where)
    check_finite_tensors(tensors, where)
    ids = draft_ids(tensors["d2t"]) if "d2t" in tensors else None
    head = build(spec, frozen_target_tensors(target.dir), ids)
    head.load_state_dict(tensors, strict=True)
    return head


# --------------------------------------------------------------------------------------------- export


def export(cfg) -> dict[str, Path]:
    """Write each layout of `cfg.export.formats` under `cfg.export.out_dir/<layout>/`.

    Every layout is built and checked before anything is written, so a refused layout leaves no
    partial export behind.
    """
    checked(cfg)
    ec = cfg.export
    # the head and the target's embeddings and lm_head read, each layout built and checked: at
    # 70B seconds to tens of seconds before the paths are printed
    print(f"export: {ec.checkpoint} as {', '.join(ec.formats)} under {ec.out_dir}", flush=True)
    return export_layouts(
        ec.checkpoint, cfg.model.target, ec.formats, Path(ec.out_dir), ec.dtype, ec.store_shared
    )


def export_layouts(
    head_dir: str | Path,
    target: Target | str | Path,
    formats: list[str],
    out_dir: Path,
    dtype: str = "bfloat16",
    store_shared: bool = False,
) -> dict[str, Path]:
    """Each layout of `formats` of the native head `head_dir`, under `out_dir/<layout>/` (validation's
    vLLM pass exports the `vllm` layout through this too)."""
    target = target if isinstance(target, Target) else Target.resolve(str(target))
    out_dir = Path(out_dir)
    head = load_head(head_dir, target)  # refuses another target
    training = read_head_config(head_dir)["training"]
    writers = {
        name: _layout_writer(name, head, target.identity, training, DTYPES[dtype], store_shared)
        for name in formats
    }
    return {name: write_atomically(out_dir / name, w) for name, w in writers.items()}


def _layout_writer(
    name: str, head: DraftHead, identity: dict, training: dict, dtype: torch.dtype, store_shared: bool
) -> Callable[[Path], None]:
    tensors = head_tensors(head, dtype, store_shared)
    if name == "native":
        config = head_config(head, identity, training, dtype, store_shared)
        return lambda d: write_files(d, tensors, config)
    if name not in LAYOUTS:
        raise ValueError(f"export.formats: unknown layout {name!r} (known: native, {', '.join(LAYOUTS)})")
    if name in HOLD_SHARED:  # the layout writes the (draft) lm_head or the embeddings itself
        tensors = head_tensors(head, dtype, store_shared=True)
    layout = LAYOUTS[name](tensors, head.spec, identity)  # refuses a head it cannot hold, saying why
    if name not in head.spec.kind.layouts:
        raise LayoutUnsupported(
            f"export.formats: layout {name} is not listed for {head.spec.variant} heads (their layouts: "
            f"{', '.join(head.spec.kind.layouts)})"
        )
    check_layout(layout.tensors, layout.table, f"layout {name}")
    if name in ("eagle3", "vllm"):
        # the native config, so that this directory alone is a head our loop reads back (head_files)
        layout.config[NATIVE_CONFIG] = head_config(head, identity, training, dtype, False)
    return lambda d: write_files(d, layout.tensors, layout.config, ENGINE_WEIGHTS)


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
@one_line_errors
def main(cfg) -> None:
    for name, path in export(cfg).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
