"""Serving-engine layouts of a trained head: names, shapes and config.json as an engine's loader reads them.

Each table below was written down from the engine's loader code (file and commit named next to it);
no engine is imported. A layout exists only where the loader rebuilds the head's math exactly: a
loader that silently drops a norm or a bias would serve a different function than the one trained.
docs/export.md says which engine serves which layout and why the rmsnorm-restored head on a Llama
target has none.

Shapes are symbolic (`"H"`, `"QD"`, ...) and resolved against the target's dimensions by `resolve`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from inference_ref.head_files import PLUGIN_LAYER
from inference_ref.head_spec import HeadSpec, draft_ids
from inference_ref.models.llama import LlamaConfig
from mtp_train.layer_names import (
    DEEPSEEK_EXPERT,
    DEEPSEEK_MOE,
    DEEPSEEK_NOAUX,
    DEEPSEEK_RENAME,
    DEEPSEEK_STACKED_EXPERTS,
    DFLASH_LAYER,
    EAGLE3_BLOCK,
    EAGLE3_LATER_BLOCK,
    LLAMA_BLOCK,
    Symbolic,
    Table,
    deepseek_attention_symbolic,
    deepseek_dense_block,
    deepseek_dims,
    llama_dims,
    resolve,
)


class LayoutUnsupported(ValueError):
    """The requested engine layout cannot carry this head without changing its math."""


@dataclass
class EngineExport:
    """One engine layout of a head, ready to write: tensors, config.json, and the table they must match."""

    tensors: dict[str, torch.Tensor]
    config: dict
    table: Table


# ---------------------------------------------------------------------------------------------
# EAGLE-1 for Llama targets.
# Read from SGLang python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0
# (`LlamaForCausalLMEagle`): `model.fc = nn.Linear(2H, H)` with its default bias, input
# `cat(embed(t), hidden)`; layer 0's input_layernorm is replaced by the identity (so the checkpoint
# has none); the output is `hidden + residual` with no final norm; load_weights prefixes `model.` and
# drops `lm_head*`, and the EAGLE worker swaps in the target's embedding and lm_head.
# The EAGLE repo's loader agrees (SafeAILab/EAGLE eagle/model/cnets1.py @ 2174a790d71a41a2e7549e14fef7d277435894b9:
# `fc` bias from config key "bias", default true; layer index 0 has no input_layernorm), but it reads a
# pickled pytorch_model.bin, which this project does not write.
# vLLM's EagleLlamaForCausalLM (vllm/model_executor/models/llama_eagle.py @ e1c4a55214c63e19e83f82ad6c552d82148bae0b)
# builds `fc` with bias=False: it cannot load this layout (see docs/export.md).
EAGLE1_SGLANG: Symbolic = {
    "fc.weight": ("H", "2H"),
    "fc.bias": ("H",),
    **{f"layers.0.{name}": shape for name, shape in LLAMA_BLOCK.items()},
}


def eagle1_export(tensors: Mapping[str, torch.Tensor], layer_config: dict, variant: str) -> EngineExport:
    """The eagle1 head as SGLang's `LlamaForCausalLMEagle` loads it."""
    if variant != "eagle1":
        raise LayoutUnsupported(
            f"layout eagle1: a {variant} head has enorm/hnorm, layer 0's input_layernorm and a final "
            "norm; the EAGLE-1 loaders (SGLang/vLLM llama_eagle.py) have none of them. "
            "A rmsnorm-restored head has no stock engine layout on a Llama target (docs/export.md): "
            "export.formats=[vllm] serves it with this package's vLLM plugin."
        )
    _require_llama(layer_config, "eagle1")
    out = {"fc.weight": tensors["fc.weight"], "fc.bias": tensors["fc.bias"]}
    out.update({f"layers.0.{n[len('layer.') :]}": t for n, t in tensors.items() if n.startswith("layer.")})
    config = {
        **layer_config,
        "architectures": ["LlamaForCausalLMEagle"],
        "num_hidden_layers": 1,
        # No "bias" key: SGLang's and vLLM's Llama decoder layer read `attention_bias or bias` as
        # "q/k/v/o have biases" and would build biases the checkpoint lacks (EAGLE issue #141,
        # vLLM #12831). SGLang's EAGLE-1 fc always has its bias; the EAGLE repo's loader reads a
        # missing "bias" as true; `eagle_fc_bias` is vLLM's own name for it (renamed in PR #9580).
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_fc_bias": True,
        "torch_dtype": _dtype_name(tensors["fc.weight"].dtype),
    }
    table = resolve(EAGLE1_SGLANG, llama_dims(LlamaConfig.from_hf(layer_config)))
    return EngineExport(out, config, table)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 for Llama targets: one decoder layer whose q/k/v read 2H ([input_layernorm(embed);
# hidden_norm(fc(aux))]), fc 3H → H without bias, a final norm and a draft-vocabulary lm_head.
# Read from SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
# (`LlamaForCausalLMEagle3`: module `midlayer`, fc `Linear(target_hidden_size * 3, H, bias=config.bias)`,
# hot_token_id = d2t + arange: d2t holds offsets, t2d skipped; lm_head `ParallelLMHead(draft_vocab_size, H)`;
# the residual is the pre-hidden_norm fc output), vLLM vllm/model_executor/models/llama_eagle3.py
# @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (`midlayer.` → `layers.0.`, d2t → draft_id_to_target_id,
# fc `ReplicatedLinear(3 * target_hidden_size, H, bias=False)`, `norm_before_residual` read, default false)
# and TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py @ 00679c66c3e38f6d2651ad0a5bef0f94d862e36c
# (`Eagle3ForCausalLM`: `midlayer.*`; `layers.0.` also renamed to it; d2t int32 loaded from the file).
# Auxiliary layer ids: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as "the state
# entering layer k" (vllm/model_executor/models/llama.py @ e06c9ba2a6ea923a84add30f5dafaea126429b81
# captures before layer idx), as this project numbers them; SGLang reads
# `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 (python/sglang/srt/models/llama.py
# @ 00239548f1cd1a06ca145a5447a86738090a48f1: "for the ith layer, it takes the output of the (i-1)th
# layer"), so that list is written one lower: both engines then capture the same states.
# A stacked head's later layers (`HeadSpec.layers` > 1), in the `vllm` layout only: vLLM builds
# `num_hidden_layers` layers, the first under `midlayer.` / `layers.0.`, layer i ≥ 1 as `layers.<i>.*`,
# a Llama layer reading H whose `hidden_norm` is built but unused and loaded strictly (so written as
# ones). SGLang refuses `num_hidden_layers` ≠ 1 (llama_eagle3.py: "EAGLE3 currently only supports 1
# layer"), and TensorRT-LLM names several layers `midlayer.<i>.*`: the `eagle3` layout refuses them.
EAGLE3_LATER: Symbolic = {**EAGLE3_LATER_BLOCK, "hidden_norm.weight": ("H",)}
EAGLE3_OWN: Symbolic = {"fc.weight": ("H", "nH"), "norm.weight": ("H",), "lm_head.weight": ("Vd", "H")}
EAGLE3_VOCAB: Symbolic = {"d2t": ("Vd",), "t2d": ("V",)}  # only with a draft vocabulary (Vd < V)


def eagle3_dims(spec: HeadSpec) -> dict[str, int]:
    return {
        **llama_dims(spec.target),
        "nH": len(spec.aux_layers) * spec.target.hidden_size,
        "Vd": spec.vocab,
    }


def _require_eagle3(spec: HeadSpec, layout: str) -> None:
    if spec.kind.blocks:
        raise LayoutUnsupported(
            f"layout {layout}: holds EAGLE-3 heads, which chain one layer's steps; a {spec.variant} head "
            "drafts a block with its own layers: export.formats=[vllm] (vLLM's DFlashDraftModel)"
        )
    if not spec.aux_layers:
        raise LayoutUnsupported(
            f"layout {layout}: holds EAGLE-3 heads (fc over the target's auxiliary layers, a 2H-input "
            f"layer with hidden_norm); a {spec.variant} head reads no auxiliary layers. Train model.variant=eagle3."
        )


def eagle3_tensors(tensors: Mapping[str, torch.Tensor], spec: HeadSpec, layer_prefix: str) -> dict:
    """The head's tensors under EAGLE-3 checkpoint names (layer under `layer_prefix`); d2t/t2d only
    with a draft vocabulary, as the EAGLE reference writes them (its loader deletes them otherwise)."""
    out = {f"{layer_prefix}{n[len('layer.') :]}": t for n, t in tensors.items() if n.startswith("layer.")}
    for i in range(1, spec.layers):  # a stacked head's later layers, with the hidden_norm vLLM builds
        prefix = f"later_layers.{i - 1}."
        out.update({f"layers.{i}.{n[len(prefix) :]}": t for n, t in tensors.items() if n.startswith(prefix)})
        out[f"layers.{i}.hidden_norm.weight"] = torch.ones_like(tensors[f"{prefix}input_layernorm.weight"])
    out.update({n: tensors[n] for n in ("fc.weight", "norm.weight", "lm_head.weight")})
    out.update({n: t for n, t in tensors.items() if n.startswith("fc_norm.")})  # EAGLE-3.1
    if spec.draft_vocab_size:
        d2t = tensors["d2t"].long()
        t2d = torch.zeros(spec.target.vocab_size, dtype=torch.bool)
        t2d[draft_ids(d2t)] = True
        out.update(d2t=d2t, t2d=t2d)
    return out


def eagle3_table(spec: HeadSpec, layer_prefix: str, extra: Symbolic | None = None) -> Table:
    fc_norms = {n: s for n, s in spec.kind.math.native_names(spec).items() if n.startswith("fc_norm.")}
    symbolic = {
        **{layer_prefix + n: s for n, s in EAGLE3_BLOCK.items()},
        **{f"layers.{i}.{n}": s for i in range(1, spec.layers) for n, s in EAGLE3_LATER.items()},
        **EAGLE3_OWN,
        **fc_norms,  # EAGLE-3.1
        **(extra or {}),
    }
    if spec.draft_vocab_size:
        symbolic.update(EAGLE3_VOCAB)
    return resolve(symbolic, eagle3_dims(spec))


def _require_one_layer(spec: HeadSpec, layout: str, holds: str) -> None:
    if spec.layers > 1:
        raise LayoutUnsupported(
            f"layout {layout}: {holds}; this head stacks {spec.layers} layers: export.formats=[vllm] "
            "(vLLM's Eagle3LlamaForCausalLM builds them all)"
        )


def eagle3_layout(tensors: Mapping[str, torch.Tensor], spec: HeadSpec, identity: dict) -> EngineExport:
    """The `eagle3` layout: for the three engines, so one layer."""
    _require_eagle3(spec, "eagle3")
    _require_one_layer(spec, "eagle3", "SGLang and TensorRT-LLM load one EAGLE-3 layer")
    return eagle3_export(tensors, spec, identity)


def eagle3_export(tensors: Mapping[str, torch.Tensor], spec: HeadSpec, identity: dict) -> EngineExport:
    """The eagle3 head as SGLang / vLLM / TensorRT-LLM `LlamaForCausalLMEagle3` load it (a stacked
    head's later layers as vLLM's). The embeddings are the target's in all three (not written)."""
    _require_eagle3(spec, "eagle3")
    t = spec.target
    dropped = ("bos_token_id", "eos_token_id", "use_sliding_window")  # the target's, not the draft layer's
    layer = {k: v for k, v in t.to_hf().items() if k not in dropped}
    config = {
        **layer,
        "model_type": "llama",  # the draft layer is a Llama layer whatever the target (Qwen3 too)
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": spec.layers,
        "draft_vocab_size": spec.vocab,
        "target_hidden_size": t.hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,
        # EAGLE-3.1's two switches (vLLM llama_eagle3.py reads both; false: EAGLE-3)
        "fc_norm": spec.kind.math.fc_norm,
        "norm_output": spec.kind.math.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
        "num_aux_hidden_states": len(spec.aux_layers),  # what vLLM sizes fc by (see speculators_export)
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [k - 1 for k in spec.aux_layers],
        },
        "torch_dtype": _dtype_name(tensors["fc.weight"].dtype),
    }
    return EngineExport(eagle3_tensors(tensors, spec, "midlayer."), config, eagle3_table(spec, "midlayer."))


# ---------------------------------------------------------------------------------------------
# vLLM's speculators format (`speculators_model_type: eagle3`), as the `speculators` package 0.9.0
# reads it (speculators/models/eagle3/config.py `Eagle3SpeculatorConfig`, core.py `Eagle3DraftModel`;
# tests/test_eagle3.py loads our export with it) and vLLM translates it
# (vllm/transformers_utils/configs/speculators/algos.py @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec
# `update_eagle3`: draft_vocab_size, target_hidden_size, norm_before_residual (default TRUE when
# absent, so it is always written), eagle_aux_hidden_state_layer_ids; base.py
# @ 052316aeab2a1b2a9076518f20fe776052b947c9 requires speculators_config.proposal_methods[0].speculative_tokens
# and speculators_config.verifier.name_or_path). The layer is `layers.0`; the embeddings are written
# too: speculators 0.9.0 leaves them uninitialised when absent.
def draft_layer_fields(t) -> dict:
    """A draft layer's shape as an engine's config reads it: the target's dimensions and rope."""
    return {
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
        "rope_scaling": t.to_hf().get("rope_scaling"),
    }


SPECULATORS_EXTRA: Symbolic = {"embed_tokens.weight": ("V", "H")}
SPECULATIVE_TOKENS = 3  # the proposal's default chain length, which the serving command can override


def speculators_export(tensors: Mapping[str, torch.Tensor], spec: HeadSpec, identity: dict) -> EngineExport:
    _require_eagle3(spec, "speculators")
    _require_one_layer(
        spec, "speculators", "holds a one-layer EAGLE-3 head (as tested with speculators 0.9.0)"
    )
    t = spec.target
    hf = t.to_hf()
    layer = {
        "model_type": "llama",
        "vocab_size": t.vocab_size,
        **draft_layer_fields(t),
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # vLLM builds fc for `num_aux_hidden_states` states, else len(eagle_config's ids), else 3
        # (llama_eagle3.py `LlamaModel.__init__`); its speculators translation copies this block into
        # the draft's config but not the count (algos.py `update_eagle3`): without it a head fusing
        # other than three layers fails to load.
        "num_aux_hidden_states": len(spec.aux_layers),
    }
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": spec.vocab,
        "norm_before_residual": False,
        "target_hidden_size": t.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": SPECULATIVE_TOKENS,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": identity.get("path"), "architectures": hf["architectures"]},
        },
        "transformer_layer_config": layer,
        "torch_dtype": _dtype_name(tensors["fc.weight"].dtype),
    }
    out = eagle3_tensors(tensors, spec, "layers.0.")
    out["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    return EngineExport(out, config, eagle3_table(spec, "layers.0.", SPECULATORS_EXTRA))


# ---------------------------------------------------------------------------------------------
# vLLM, through this package's plugin (`mtp_train.serving.vllm_plugin`, `vllm_models`): the classes
# stock vLLM lacks. The table is what those classes load (their `load_weights`, strict both ways);
# they were written against vLLM 0.32.0's EAGLE proposer (vllm/v1/spec_decode/llm_base_proposer.py)
# and its Llama / Qwen3 decoder layers (vllm/model_executor/models/llama.py, qwen3.py).
#   rmsnorm-restored → `Eagle3MTPTrainRestoredForCausalLM`, method "eagle3", with the target's last layer
#       (`eagle_aux_hidden_state_layer_ids: [num_hidden_layers]`: vLLM captures hidden + residual after
#       the last layer, the state before the final norm, llama.py `_maybe_add_hidden_state`) as its one
#       captured state: the h it was trained on. A draft vocabulary adds `lm_head.weight [Vd, H]`, `d2t`.
#   eagle1 → `EagleMTPTrainEagle1ForCausalLM`, method "eagle" (the target's post-final-norm output,
#       EAGLE-1's features), with fc's bias (vLLM's own EagleLlamaForCausalLM has none and its loader
#       drops a checkpoint's `fc.bias` silently: AutoWeightsLoader ignores unexpected `.bias` names);
#       a draft vocabulary as for the restored head.
#   eagle3 → the `eagle3` layout: stock vLLM's `Eagle3LlamaForCausalLM` serves it as it is.
VLLM_QK_NORMS: Symbolic = {"self_attn.q_norm.weight": ("D",), "self_attn.k_norm.weight": ("D",)}  # Qwen3
VLLM_VOCAB: Symbolic = {"lm_head.weight": ("Vd", "H"), "d2t": ("Vd",)}  # only with a draft vocabulary
VLLM_LAYER_KINDS = ("llama", "qwen3")  # the plugin's decoder layers (vllm_models.decoder_layer)


def vllm_own(spec: HeadSpec) -> Symbolic:
    """The head's own tensors as the plugin's classes name them: the native names
    (`HeadKind.math.native_names`), the layer's under `layers.0.` instead of `layer.`."""
    return {
        (PLUGIN_LAYER + n[len("layer.") :] if n.startswith("layer.") else n): shape
        for n, shape in spec.kind.math.native_names(spec).items()
    }


def vllm_table(spec: HeadSpec) -> Table:
    block = {**LLAMA_BLOCK, **(VLLM_QK_NORMS if spec.target.model_type == "qwen3" else {})}
    symbolic = {**vllm_own(spec), **{PLUGIN_LAYER + n: s for n, s in block.items()}}
    if spec.draft_vocab_size:
        symbolic.update(VLLM_VOCAB)
    return resolve(symbolic, {**llama_dims(spec.target), "D": spec.target.head_dim, "Vd": spec.vocab})


def vllm_export(tensors: Mapping[str, torch.Tensor], spec: HeadSpec, identity: dict) -> EngineExport:
    """The head as vLLM serves it: eagle3 in the stock `eagle3` layout, the rmsnorm-restored and
    eagle1 heads for the plugin's classes (config.json names the class and carries an `mtp_train`
    block the class checks: format, version, variant, the target)."""
    from mtp_train.serving import vllm_plugin  # constants only: imports no vLLM

    if spec.kind.blocks:  # dflash: stock vLLM's DFlashDraftModel
        return dflash_export(tensors, spec)
    if spec.kind.fuses_aux:  # eagle3, eagle3.1: stock vLLM's Eagle3LlamaForCausalLM
        export = eagle3_export(tensors, spec, identity)
        if not spec.draft_vocab_size:
            # The whole vocabulary: the lm_head is the target's own, and vLLM 0.32 shares the
            # target's where the checkpoint has none (`has_own_lm_head`, set by utils.py
            # process_eagle_weight; llm_base_proposer.py `_maybe_share_lm_head`): V × H less to ship.
            del export.tensors["lm_head.weight"], export.table["lm_head.weight"]
        return export
    if spec.variant not in vllm_plugin.ARCHITECTURES:
        raise LayoutUnsupported(f"layout vllm: no vLLM class serves a {spec.variant} head")
    kind = spec.target.model_type
    if kind not in VLLM_LAYER_KINDS:
        raise LayoutUnsupported(
            f"layout vllm: the plugin builds the head's layer as vLLM builds a {VLLM_LAYER_KINDS} "
            f"target's; this head's layer is {kind!r}"
        )
    t = spec.target
    out = {n: tensors[n] for n in vllm_own(spec) if not n.startswith("layers.")}
    out.update({PLUGIN_LAYER + n[len("layer.") :]: w for n, w in tensors.items() if n.startswith("layer.")})
    if spec.draft_vocab_size:
        out.update({"lm_head.weight": tensors["lm_head.weight"], "d2t": tensors["d2t"].long()})
    dropped = ("bos_token_id", "eos_token_id", "use_sliding_window", "architectures")
    config = {
        **{k: v for k, v in t.to_hf().items() if k not in dropped},
        "architectures": [vllm_plugin.ARCHITECTURES[spec.variant]],
        "num_hidden_layers": 1,
        "draft_vocab_size": spec.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        **(
            {"eagle_aux_hidden_state_layer_ids": [t.num_hidden_layers]}
            if spec.variant == "rmsnorm-restored"
            else {}
        ),
        "mtp_train": {
            "format": vllm_plugin.FORMAT,
            "format_version": vllm_plugin.FORMAT_VERSION,
            "variant": spec.variant,
            "method": vllm_plugin.METHODS[spec.variant],
            "layer_kind": kind,
            "target_layers": t.num_hidden_layers,
            "target": identity,
        },
        "torch_dtype": _dtype_name(tensors["fc.weight"].dtype),
    }
    return EngineExport(out, config, vllm_table(spec))


# ---------------------------------------------------------------------------------------------
# DFlash, as stock vLLM loads it: `DFlashDraftModel` → vllm/model_executor/models/qwen3_dflash.py
# `DFlashQwen3ForCausalLM` (vLLM 0.32.0), the config SpecForge (configs/qwen3-8b-dflash.json @ a6b6b02)
# and ModelOpt's exporter write. Its loader prefixes `model.` to every name but lm_head, maps q/k/v
# and gate/up onto its fused projections, d2t → draft_id_to_target_id (t2d dropped), and shares the
# target's embeddings and lm_head where the checkpoint has none (`process_eagle_weight`,
# llm_base_proposer `_maybe_share_*`). `dflash_config.target_layer_ids` are layer outputs: vLLM
# captures layer id + 1 (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
# `get_eagle3_aux_layers_from_config`), the entering-state numbering used here. The draft layers are
# Qwen3's whatever the target (the class is Qwen3's), with the target's rope; no `layer_types`, no
# `dflash_config.causal`: every layer attends without a causal mask inside the block, as trained.
DFLASH_OWN: Symbolic = {"fc.weight": ("H", "nH"), "hidden_norm.weight": ("H",), "norm.weight": ("H",)}


def dflash_table(spec: HeadSpec) -> Table:
    symbolic = {
        **DFLASH_OWN,
        **{f"layers.{i}.{n}": s for i in range(spec.layers) for n, s in DFLASH_LAYER.items()},
        **(VLLM_VOCAB if spec.draft_vocab_size else {}),
    }
    dims = {**eagle3_dims(spec), "D": spec.target.head_dim}
    return resolve(symbolic, dims)


def dflash_export(tensors: Mapping[str, torch.Tensor], spec: HeadSpec) -> EngineExport:
    t = spec.target
    out = {n: tensors[n] for n in DFLASH_OWN}
    out.update({f"layers.{n[len('layer.') :]}": w for n, w in tensors.items() if n.startswith("layer.")})
    if spec.draft_vocab_size:
        out.update({"lm_head.weight": tensors["lm_head.weight"], "d2t": tensors["d2t"].long()})
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **draft_layer_fields(t),
        "vocab_size": t.vocab_size,
        "draft_vocab_size": spec.vocab,
        "target_hidden_size": t.hidden_size,
        "num_hidden_layers": spec.layers,
        "num_target_layers": t.num_hidden_layers,
        "block_size": spec.block_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": [k - 1 for k in spec.aux_layers],
        },
        "torch_dtype": _dtype_name(tensors["fc.weight"].dtype),
    }
    return EngineExport(out, config, dflash_table(spec))


def _require_llama(layer_config: dict, layout: str) -> None:
    if layer_config.get("model_type") != "llama":
        raise LayoutUnsupported(
            f"layout {layout}: needs a Llama target, not {layer_config.get('model_type')!r}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# DeepSeek MTP (DeepSeek-V2/V3 kind targets).
# Read from vLLM vllm/model_executor/models/deepseek_mtp.py @ 03356f8cb59ba27f3d0ce8866d7516b5e32cff65
# (`DeepSeekMultiTokenPredictorLayer`, `DeepSeekMTP.load_weights`, `_rewrite_spec_layer_name`): the MTP
# layer is `model.layers.{N}` with N = config.num_hidden_layers; `enorm`, `hnorm`, `eh_proj`
# (Linear 2H→H, no bias, input `cat(enorm(embed), hnorm(h))`) and `shared_head.norm` live under it,
# every other name under it is the block, a `DeepseekV2DecoderLayer` (input_layernorm kept); logits are
# `shared_head.head(shared_head.norm(y))`, and the next step is fed y (pre-norm).
# `embed_tokens` and `shared_head.head` are shared with the target by recent vLLM and SGLang; DeepSeek's
# own checkpoints also carry them under layer N, so they are written when `store_shared`.
# SGLang python/sglang/srt/models/deepseek_nextn.py @ c28bdc9012d29bed6b96688a44d6788157ef3d86 reads the
# same names through DeepseekV2ForCausalLM.load_weights(is_nextn=True), whose layer index is
# `0 if num_hidden_layers == 1 else num_hidden_layers`; so one directory serves both, for a head whose
# block has the target's MoE. The block's MLP kind: vLLM's DeepseekV2DecoderLayer takes its layer index
# from the prefix (N) and builds a MoE only if `N >= first_k_dense_replace` (and N % moe_layer_freq == 0),
# else a dense DeepseekV2MLP of `intermediate_size`; so a head with a dense MLP (this project's default)
# is exported with `first_k_dense_replace = N + 1`, and a head with the MoE block (`head_mlp: moe`)
# keeps the target's value, so both engines build layer N as the MoE it is. SGLang's
# DeepseekV2DecoderLayer makes every NextN layer sparse (`_is_layer_sparse` returns True for
# is_nextn): it cannot load a dense-MLP head, only an MoE one.
DEEPSEEK_MTP_OWN: Symbolic = {
    "enorm.weight": ("H",),
    "hnorm.weight": ("H",),
    "eh_proj.weight": ("H", "2H"),
    "shared_head.norm.weight": ("H",),
}
DEEPSEEK_MTP_SHARED: Symbolic = {"embed_tokens.weight": ("V", "H"), "shared_head.head.weight": ("V", "H")}


def deepseek_is_moe(hf: Mapping, layer: int) -> bool:
    """vLLM DeepseekV2DecoderLayer's rule for a MoE MLP at `layer`."""
    return (
        hf.get("n_routed_experts") is not None
        and layer >= hf.get("first_k_dense_replace", 0)
        and layer % hf.get("moe_layer_freq", 1) == 0
    )


def deepseek_layer_symbolic(hf: Mapping, layer: int) -> Symbolic:
    """Names and symbolic shapes of one DeepSeek decoder layer (relative to `model.layers.{layer}.`)."""
    if not deepseek_is_moe(hf, layer):
        return deepseek_dense_block(hf)
    table = deepseek_attention_symbolic(hf)
    table.update({k: v for k, v in DEEPSEEK_MOE.items() if "shared" not in k or hf.get("n_shared_experts")})
    if hf.get("topk_method") == "noaux_tc":
        table.update(DEEPSEEK_NOAUX)
    for e in range(hf["n_routed_experts"]):
        table.update({k.format(e=e): v for k, v in DEEPSEEK_EXPERT.items()})
    return table


def deepseek_mtp_table(hf: Mapping, store_shared: bool) -> Table:
    """The MTP layer's full table under `model.layers.{num_hidden_layers}.`."""
    n = hf["num_hidden_layers"]
    symbolic = {**DEEPSEEK_MTP_OWN, **deepseek_layer_symbolic(hf, n)}
    if store_shared:
        symbolic.update(DEEPSEEK_MTP_SHARED)
    return resolve(symbolic, deepseek_dims(hf), prefix=f"model.layers.{n}.")


def to_deepseek_mtp(tensors: Mapping[str, torch.Tensor], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """Rename a rmsnorm-restored head's tensors into the DeepSeek MTP layer `model.layers.{N}`,
    stacked experts written one per expert and projection."""
    prefix = f"model.layers.{num_hidden_layers}."
    out = {}
    for name, t in tensors.items():
        inner = name[len("layer.") :] if name.startswith("layer.") else DEEPSEEK_RENAME[name]
        if inner in DEEPSEEK_STACKED_EXPERTS:
            out.update({prefix + n: w for n, w in unstack_experts(inner, t).items()})
        else:
            out[prefix + inner] = t
    return out


def unstack_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`mlp.experts.gate_up_proj` [E, 2I, H] or `mlp.experts.down_proj` [E, H, I] → one tensor per
    expert and projection, as checkpoints store them and the engines' loaders read them."""
    if name == "mlp.experts.down_proj":
        return {f"mlp.experts.{e}.down_proj.weight": w.contiguous() for e, w in enumerate(t)}
    return {
        f"mlp.experts.{e}.{proj}.weight": w.contiguous()
        for e, expert in enumerate(t)
        for proj, w in zip(("gate_proj", "up_proj"), expert.chunk(2, dim=0))
    }


def deepseek_mtp_export(
    tensors: Mapping[str, torch.Tensor], layer_config: dict, variant: str
) -> EngineExport:
    """The head as vLLM's DeepSeekMTP and SGLang's DeepseekV3ForCausalLMNextN load it."""
    if layer_config.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
        raise LayoutUnsupported(
            "layout deepseek_mtp: the DeepSeek MTP loaders (vLLM deepseek_mtp.py, SGLang deepseek_nextn.py) "
            "build the block as a DeepseekV2DecoderLayer (MLA attention, MoE); a "
            f"{layer_config.get('model_type')!r} layer has no tensors there. See docs/export.md."
        )
    if variant != "rmsnorm-restored":
        raise LayoutUnsupported(f"layout deepseek_mtp: needs enorm/hnorm/norm, which a {variant} head lacks")
    store_shared = "lm_head.weight" in tensors
    config = deepseek_mtp_config(layer_config, dense_mlp="layer.mlp.gate_proj.weight" in tensors)
    out = to_deepseek_mtp(tensors, layer_config["num_hidden_layers"])
    return EngineExport(out, config, deepseek_mtp_table(config, store_shared))


def deepseek_mtp_config(hf: Mapping, dense_mlp: bool) -> dict:
    """The target's config with one next-n layer. vLLM turns model_type deepseek_v3 into its
    DeepSeekMTPModel; SGLang turns a draft's DeepseekV3ForCausalLM into DeepseekV3ForCausalLMNextN.
    A V2 target keeps its own routing fields (topk_method, scoring_func), which both read. A head
    with a dense MLP moves `first_k_dense_replace` past its layer N, so vLLM builds that MLP dense."""
    config = {
        **hf,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_nextn_predict_layers": 1,
    }
    if dense_mlp:
        n = hf["num_hidden_layers"]
        config["first_k_dense_replace"] = max(hf.get("first_k_dense_replace") or 0, n + 1)
    return config


Exporter = Callable[[Mapping[str, torch.Tensor], HeadSpec, dict], EngineExport]
"""(the head's tensors under native names, shared ones included where the layout needs them; its
spec; the target's identity) → the layout."""


def whole_vocabulary(spec: HeadSpec, layout: str) -> HeadSpec:
    """Refuse a draft vocabulary in a layout whose loader scores the whole target vocabulary."""
    if spec.draft_vocab_size:
        raise LayoutUnsupported(
            f"layout {layout}: the engine's {spec.variant} loader scores the whole target vocabulary, "
            f"this head a draft vocabulary of {spec.vocab} tokens (model.draft_vocab_size): export "
            "it native, or train it with model.draft_vocab_size=null"
        )
    return spec


HOLD_SHARED = frozenset({"eagle3", "speculators", "vllm"})
"""The layouts that write shared tensors themselves: the draft lm_head (eagle3, and vllm with a draft
vocabulary), the embeddings (speculators); they are built from the head's tensors with the shared ones."""

LAYOUTS: dict[str, Exporter] = {
    "eagle1": lambda tensors, spec, identity: eagle1_export(
        tensors, whole_vocabulary(spec, "eagle1").target.to_hf(), spec.variant
    ),
    "deepseek_mtp": lambda tensors, spec, identity: deepseek_mtp_export(
        tensors, whole_vocabulary(spec, "deepseek_mtp").target.to_hf(), spec.variant
    ),
    "eagle3": eagle3_layout,
    "speculators": speculators_export,
    "vllm": vllm_export,
}
