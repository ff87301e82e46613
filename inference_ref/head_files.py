"""A head directory read as the native format, whichever of the two this project writes it is:

- a native export: `head.safetensors` under the training module's names, `config.json` with
  `format: mtp-train-head`;
- an engine export that carries the native config under `mtp_train_head` in the `config.json` the
  engine reads, beside `model.safetensors` under the engine's names: the `eagle3` layout and the
  `vllm` layout of eagle3 / eagle3.1 heads (the EAGLE-3 layout: `midlayer.`), the `vllm` layout
  of rmsnorm-restored / eagle1 heads (the plugin's: `layers.0.`) and that of dflash heads (vLLM's
  DFlashDraftModel: `layers.<i>.`). Its tensors are renamed back here.

So a published head is one directory that vLLM serves as it is and that our loop validates.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from inference_ref.head_spec import CONFIG, HEAD_KINDS, WEIGHTS, read_json

ENGINE_WEIGHTS = "model.safetensors"
"""The engine layouts' weights file (the engines read every *.safetensors of a draft directory)."""
NATIVE_CONFIG = "mtp_train_head"
"""The config.json key under which an engine export keeps the native config it was made from."""
EAGLE3_LAYER = "midlayer."
"""The decoder layer's prefix in the EAGLE-3 layout (`layer.` natively)."""
PLUGIN_LAYER = "layers.0."
"""The decoder layer's prefix in the vLLM plugin's layout of rmsnorm-restored / eagle1 heads."""
DFLASH_LAYERS = "layers."
"""The decoder layers' prefix in vLLM's DFlashDraftModel layout (`layers.<i>.`; `layer.<i>.` natively)."""


def read_config(path: Path) -> dict:
    """A head directory's config.json as it is."""
    if not (path / CONFIG).exists():
        missing = f"no {CONFIG}" if path.is_dir() else "no such directory"
        raise FileNotFoundError(
            f"{path}: {missing} (expected a head directory: a native or eagle3/vllm export)"
        )
    return read_json(path / CONFIG)


def native_config(config: dict, path: Path) -> dict:
    """The native config in a head directory's `config` (its format checked by
    `HeadSpec.from_config`); an engine export that carries none is refused."""
    if NATIVE_CONFIG in config:
        native = config[NATIVE_CONFIG]
        kind = HEAD_KINDS.get(native.get("variant"))
        if kind is None:
            variant = native.get("variant")
            raise ValueError(f"{path / CONFIG}: {NATIVE_CONFIG}.variant: unknown head kind {variant!r}")
        return native
    if "format" not in config:  # an engine layout without the native config
        arch = (config.get("architectures") or ["?"])[0]
        raise ValueError(
            f"{path / CONFIG}: an engine export ({arch}) that carries no native config "
            f"({NATIVE_CONFIG}): point at the head's native export"
        )
    return config


def read_native_config(path: str | Path) -> dict:
    """The native config of a head directory, native or engine export."""
    path = Path(path)
    return native_config(read_config(path), path)


def weights_file(path: str | Path, config: dict | None = None) -> Path:
    """The weights file of a head directory (`config`: its config.json, where already read): a
    native head's, or an engine export's."""
    path = Path(path)
    config = read_config(path) if config is None else config
    return path / (ENGINE_WEIGHTS if native_config(config, path) is not config else WEIGHTS)


def read_head_files(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(native config, tensors under native names) of a head directory."""
    path = Path(path)
    config = read_config(path)
    native = native_config(config, path)
    weights = weights_file(path, config)
    if not weights.exists():
        raise FileNotFoundError(f"{path}: no {weights.name} beside its {CONFIG}")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors' own errors name no file
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from e
    if native is config:
        return native, tensors
    if HEAD_KINDS[native["variant"]].blocks:
        return native, native_from_layers(tensors, DFLASH_LAYERS)
    if any(name.startswith(PLUGIN_LAYER) for name in tensors):
        return native, native_from_layers(tensors, PLUGIN_LAYER)
    return native, native_from_eagle3(tensors, native["draft_vocab_size"])


def native_from_layers(tensors: dict[str, torch.Tensor], engine_prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of a layout that renames the layer prefix only: `engine_prefix` back to `layer.`
    (the plugin's layout: `layers.0.` → `layer.`; DFlashDraftModel's: `layers.<i>.` → `layer.<i>.`).
    Every other tensor (enorm, hnorm, fc, hidden_norm, norm, a draft vocabulary's d2t) keeps its
    native name. A draft vocabulary's lm_head rows are dropped: they are the target's rows at d2t's
    ids (in the export's dtype), which the native head takes from the target itself."""
    return {
        ("layer." + name[len(engine_prefix) :] if name.startswith(engine_prefix) else name): t
        for name, t in tensors.items()
        if name != "lm_head.weight"
    }


def native_from_eagle3(tensors: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """The inverse of the EAGLE-3 layout's renaming: the layer back under `layer.`, fc, norm and
    EAGLE-3.1's fc_norm as they are. The layout's lm_head rows and t2d are the target's lm_head
    and the set of d2t's ids, which the native head takes from the target and d2t; d2t is all
    zeros where the layout omits it (the whole vocabulary). A stacked head's `layers.<i>` (i ≥ 1) go
    back under `later_layers.<i − 1>`, without the hidden_norm only the engine builds for them."""
    out = {}
    for name, t in tensors.items():
        if name.startswith(EAGLE3_LAYER):
            out["layer." + name[len(EAGLE3_LAYER) :]] = t
        elif name.startswith("layers."):  # never layers.0: that layout is the plugin's
            i, rest = name[len("layers.") :].split(".", 1)
            if rest != "hidden_norm.weight":
                out[f"later_layers.{int(i) - 1}.{rest}"] = t
        elif name not in ("lm_head.weight", "t2d"):
            out[name] = t
    out.setdefault("d2t", torch.zeros(vocab, dtype=torch.long))
    return out
