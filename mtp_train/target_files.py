"""Where targets come from, and how a store or head names the target it was made with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference_ref.cpu_linear import cpuinfo
from inference_ref.gguf import convert_gguf
from inference_ref.target import TARGET_KINDS, TargetConfig, read_target_config
from mtp_train.demo_target import cache_dir, smollm2_dir

DEMO_TARGET = "smollm2-135m-instruct"


def resolve_target(spec: str) -> Path:
    """A Hugging Face directory for `spec`: a directory, a `.gguf` (converted once), or the demo alias."""
    if spec == DEMO_TARGET:
        return smollm2_dir()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        out = cache_dir() / f"{path.stem}-{_short_hash(str(path.resolve()))}"
        if not (out / "config.json").exists():
            convert_gguf(path, out)
        return out
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"target {spec!r}: no config.json in {path} (expected a Hugging Face directory)"
        )
    return path


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _file_hash(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def weights_hash(model_dir: Path) -> str:
    """A cheap fingerprint of the weights: each safetensors file's size, header and first and
    last MiB. Two targets of one shape but different weights differ here."""
    h = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(size.to_bytes(8, "little") + f.read(header_len) + f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]


def target_identity(model_dir: str | Path, config: TargetConfig | None = None) -> dict:
    """What must match between a target and the stores and heads made from it (`config`: the
    target's, where the caller has read it already)."""
    model_dir = Path(model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    template = tok.chat_template or ""
    return {
        "path": str(model_dir.resolve()),
        "config_hash": (config or read_target_config(model_dir)).fingerprint(),
        "weights_hash": weights_hash(model_dir),
        "tokenizer_hash": _file_hash(model_dir / "tokenizer.json"),
        "vocab_hash": vocab_hash(tok),
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest()[:16],
    }


def vocab_hash(tok) -> str:
    """The tokenizer's token ↔ id map, which is what a head's ids mean. tokenizer.json's bytes are
    not: two transformers versions write different files for one GGUF's tokenizer (decoder and
    fallback settings) with the same vocabulary and the same ids."""
    pairs = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


def check_same_target(expected: dict, found: dict, what: str) -> None:
    """Raise naming the first field on which `found` (e.g. a store's manifest) differs from the target."""
    # Records made before vocab_hash existed are compared by tokenizer.json's bytes.
    vocab = "vocab_hash" if "vocab_hash" in expected and "vocab_hash" in found else "tokenizer_hash"
    for key in ("config_hash", "weights_hash", vocab, "chat_template_hash"):
        if expected.get(key) != found.get(key):
            raise ValueError(
                f"{what} was made with another target: {key} is {found.get(key)!r}, "
                f"the configured target {expected.get('path')} has {expected.get(key)!r}"
            )


def random_hf_weights(cfg: TargetConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of `cfg`'s kind under Hugging Face names."""
    kind = TARGET_KINDS[cfg.model_type]
    return kind.hf_state_dict(kind.random(cfg, seed=seed))


def write_random_target(
    out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, kind: str = "llama", **shape
) -> Path:
    """A tiny random target of `kind` (`llama`, `deepseek_v2`) sharing a real tokenizer: the debug
    model for CPU runs and tests."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = read_target_config(tokenizer_dir)
    cfg = TARGET_KINDS[kind].config(
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_ids=base.eos_token_ids,
        **{**TARGET_KINDS[kind].tiny, **shape},
    )
    save_file(random_hf_weights(cfg, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / name
        if src.exists():
            (out_dir / name).write_bytes(src.read_bytes())
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return out_dir


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (Intel AMX): there bf16 runs the target
    about 2.7× faster than fp32 (SmolLM2 forward, 2 cores), elsewhere it is slower."""
    return "amx_bf16" in cpuinfo()


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """`model.dtype`: auto is bf16 on CUDA (what serving runs) and on CPUs with native bf16
    matrix units, fp32 on other CPUs."""
    fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
    dtypes = {"auto": torch.bfloat16 if fast_bf16 else torch.float32}
    dtypes.update(bfloat16=torch.bfloat16, float32=torch.float32)
    if name not in dtypes:
        raise ValueError(f"model.dtype must be one of {list(dtypes)}, got {name!r}")
    return dtypes[name]
