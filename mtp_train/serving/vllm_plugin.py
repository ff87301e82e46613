"""vLLM plugin: registers the model classes stock vLLM lacks for this project's heads.

Loaded by vLLM itself in every process it starts (the API server or `LLM` process, the engine core,
each worker) through the `vllm.general_plugins` entry point in pyproject.toml
(vllm/plugins/__init__.py `load_general_plugins`, called from vllm/engine/arg_utils.py,
vllm/v1/engine/core.py and vllm/v1/worker/worker_base.py). This module imports nothing but the
standard library until `register` runs, and then only vLLM: a serving host needs vLLM and torch,
not the training stack (no DeepSpeed, Hydra, accelerate). The classes live in
`mtp_train.serving.vllm_models` (torch and vLLM only).

Each class computes exactly one head kind's math (inference_ref/head_spec.py) and loads the
`vllm` export layout (`mtp_train.serving.layouts.vllm_export`) without conversion:

    rmsnorm-restored → `Eagle3MTPTrainRestoredForCausalLM`, served with `"method": "eagle3"`: vLLM
        captures the target's last-layer state before its final norm as the one "auxiliary" state
        (config `eagle_aux_hidden_state_layer_ids: [num_hidden_layers]`), so h is the state the head
        was trained on; x = fc([enorm(embed(t)); hnorm(h)]), one decoder layer of the target's kind
        with its input_layernorm, y pre-norm fed to the next step, logits = lm_head(norm(y)).
    eagle1 → `EagleMTPTrainEagle1ForCausalLM`, served with `"method": "eagle"`: vLLM feeds the
        target's output after its final norm, f = final_norm(h), as EAGLE-1 reads it;
        x = fc([embed(t); f]) + bias (vLLM's own EagleLlamaForCausalLM builds fc without the bias and
        its loader drops `fc.bias` silently), the layer without input_layernorm, logits = lm_head(y).

The names start with "Eagle3" / "Eagle" because vLLM's EAGLEConfig renames a draft architecture
that does not (vllm/transformers_utils/configs/eagle.py).
"""

from __future__ import annotations

FORMAT, FORMAT_VERSION = "mtp-train-vllm", 1
"""The `mtp_train` block of a `vllm` layout's config.json: the classes refuse another format or version."""

ARCHITECTURES = {
    "rmsnorm-restored": "Eagle3MTPTrainRestoredForCausalLM",
    "eagle1": "EagleMTPTrainEagle1ForCausalLM",
}
"""Head variant → the architecture its `vllm` export names (config.json `architectures`)."""

METHODS = {
    "rmsnorm-restored": "eagle3",
    "eagle1": "eagle",
    "eagle3": "eagle3",
    "eagle3.1": "eagle3",
    "dflash": "dflash",
}
"""Head variant → vLLM's `speculative_config.method` that serves its `vllm` export."""

STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
"""Checkpoint (Hugging Face) name part → (vLLM's fused parameter part, shard), as vLLM's Llama
loaders fuse them: read by the plugin's loaders and by the engine runner's weight check."""


def register() -> None:
    """The `vllm.general_plugins` entry point: register each class under its architecture name.
    Safe to call more than once (vLLM may load plugins in one process several times).

    The classes are registered themselves, not as `"module:Class"` strings: a string makes vLLM
    inspect the class in a fresh Python process the first time (~20 s per class on a 2-core CPU,
    again after every change of the module); importing them here costs about a second and
    initializes no device."""
    from vllm import ModelRegistry

    from mtp_train.serving import vllm_models

    for arch in ARCHITECTURES.values():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, getattr(vllm_models, arch))
