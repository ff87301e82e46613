"""A target of any registered kind (`inference_ref.models.TARGET_KINDS`), chosen by its `config.json`'s
`model_type`: reading its config, loading it, and reading the tensors a head shares.

Every kind's model is a `causal_lm.CausalLM` (`forward_packed`, `new_cache`, `forward_cached`,
`logits`; embeddings, final norm and lm_head under the same attribute names), so precompute,
generation, the speculative loop and validation run any of them unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from inference_ref.causal_lm import CausalLM
from inference_ref.gguf import load_gguf
from inference_ref.loading import EMBED, LM_HEAD, is_scale, read_tensors, safetensors_files
from inference_ref.models import TARGET_KINDS, Cache, kind_of
from inference_ref.models import Config as TargetConfig
from inference_ref.quantization import quantize_onto

TargetModel = CausalLM
"""What the pipeline uses of a target: the skeleton every kind shares."""

__all__ = [
    "Cache",
    "TARGET_KINDS",
    "TargetConfig",
    "TargetModel",
    "read_target_config",
    "load_target",
    "frozen_target_tensors",
    "eos_ids",
]


def eos_ids(target: CausalLM, tokenizer) -> list[int]:
    """The tokens that end a reply: the tokenizer's eos and the target config's (a chat model's
    config often lists its end-of-turn token there, which the tokenizer does not call eos)."""
    return sorted({tokenizer.eos_token_id, *target.cfg.eos_token_ids} - {None})


def read_target_config(path: str | Path) -> TargetConfig:
    """The config of the checkpoint directory at `path`, of its own kind."""
    file = Path(path) / "config.json"
    hf = json.loads(file.read_text())
    return kind_of(hf.get("model_type"), str(file)).config.from_hf(hf)


def load_target(
    path: str | Path,
    device="cpu",
    dtype=torch.float32,
    compile: bool = False,
    quantization: str = "none",
    tp_mesh=None,
    headroom: float = 0.1,
    say=None,
) -> TargetModel:
    """Load a target from a Hugging Face directory (any kind) or a Llama `.gguf` file.
    `quantization="fp8"` turns its layers' linear maps into FP8 ones, layer by layer as they reach
    the device (`quantization.quantize_onto`: the device never holds the whole target unquantized);
    `"fp8_static"` with static input scales, which the caller calibrates before the first forward
    (`quantization.calibration`).
    `compile` fuses its layers (`CausalLM.compile_layers`) where that is measured: on CUDA, for a
    kind that is `compilable`; elsewhere it is ignored. `tp_mesh` (a one-dimensional device mesh of
    more than one rank) shards it (`inference_ref.tensor_parallel`), each rank reading only its
    shards. On a GPU, a target whose weights would leave less than `headroom` of its memory free is
    refused before anything is read. `say`: where to announce the load, which reads the whole
    checkpoint (16 GB at 8B: tens of seconds; a 70B share: minutes) before its caller prints again."""
    from inference_ref import tensor_parallel

    path = Path(path)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    if quantization not in ("none", "fp8", "fp8_static"):
        raise ValueError(f"model.quantization: {quantization!r} is not one of none, fp8, fp8_static")
    fp8 = quantization != "none"
    if fp8 and tp > 1:
        raise ValueError(
            f"model.quantization={quantization} with model.tp_size={tp} is not supported yet: use one of them"
        )
    if path.suffix == ".gguf":
        if tp > 1:
            raise ValueError(
                f"{path}: a .gguf target loads whole; convert it to a directory for model.tp_size={tp}"
            )
        _announce(say, path, device, tp, quantization)
        model = load_gguf(path, "cpu" if fp8 else device, dtype)
    else:
        cfg = read_target_config(path)
        check_checkpoint(path, cfg)  # headers only: before anything large is read
        if tp > 1:
            tensor_parallel.check_shardable(cfg, tp)
        tensor_parallel.check_fits(cfg, tp, torch.device(device), dtype, quantization, headroom)
        _announce(say, path, device, tp, quantization)
        if tp > 1:
            model = tensor_parallel.load_parallel(path, cfg, tp_mesh, device, dtype)
        else:  # FP8: built on the CPU, quantized layer by layer on its way to the device
            model = TARGET_KINDS[cfg.model_type].load(path, "cpu" if fp8 else device, dtype)
    if fp8:  # fp8_static: the caller calibrates (`calibration`)
        model = quantize_onto(model, device, static_inputs=quantization == "fp8_static")
    if compile and torch.device(device).type == "cuda" and model.compilable:
        model.compile_layers()
    return model


def _announce(say, path: Path, device, tp: int, quantization: str) -> None:
    if say is None:
        return
    files = [path] if path.suffix == ".gguf" else set(safetensors_files(path).values())
    size = sum(Path(f).stat().st_size for f in files)
    how = (f", {tp}-way tensor parallel" if tp > 1 else "") + (
        f", {quantization}" if quantization != "none" else ""
    )
    say(f"loading the target {path} ({size / 1e9:.1f} GB on disk) onto {device}{how}")


def check_checkpoint(path: Path, cfg: TargetConfig) -> None:
    """Refuse a checkpoint whose tensor names or shapes do not match its config.json, naming the
    first mismatch (expected vs found): the shapes are read from the safetensors headers and set
    against those the kind's model of this config has, under the checkpoint's names."""
    kind = TARGET_KINDS[cfg.model_type]
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in kind.hf_state_dict(kind.model(cfg)).items()}
    found = checkpoint_shapes(path)
    stacked = {n for n in found if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for name in sorted(expected):
        if name not in found and not any(
            name.startswith(s.rsplit("experts.", 1)[0] + "experts.") for s in stacked
        ):
            raise ValueError(
                f"{path}: tensor {name} {list(expected[name])} is missing (config.json: {cfg.model_type})"
            )
        if name in found and found[name] != expected[name]:
            raise ValueError(
                f"{path}: tensor {name} has shape {list(found[name])}, config.json implies {list(expected[name])}"
            )
    layers = cfg.num_hidden_layers
    for name in sorted(set(found) - set(expected) - stacked):
        beyond = name.startswith("model.layers.") and int(name.split(".")[2]) >= layers  # a shipped MTP layer
        if not (beyond or name.endswith("rotary_emb.inv_freq") or name == LM_HEAD or is_scale(name)):
            raise ValueError(
                f"{path}: tensor {name} {list(found[name])} has no place in a {cfg.model_type} of this config"
            )


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers (no data read)."""
    out = {}
    for file in set(safetensors_files(path).values()):  # each file's header once
        with safe_open(file, "pt") as f:
            out.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return out


def frozen_target_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors a head shares with its target (embeddings, final norm, lm_head; the embeddings
    again when tied), read by name only."""
    cfg = read_target_config(model_dir)
    names = [n for n in TARGET_KINDS[cfg.model_type].shared if not (cfg.tie_word_embeddings and n == LM_HEAD)]
    out = read_tensors(model_dir, names)
    out.setdefault(LM_HEAD, out[EMBED])
    return out
