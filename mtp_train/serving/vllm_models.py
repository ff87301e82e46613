"""vLLM model classes for this project's heads (registered by `mtp_train.serving.vllm_plugin`).

Imports only torch and vLLM (and the plugin's constants). Read against vLLM 0.32.0:
vllm/model_executor/models/llama_eagle3.py (`Eagle3LlamaForCausalLM`, whose interface the EAGLE-3
proposer asserts: vllm/v1/spec_decode/llm_base_proposer.py `propose`), llama_eagle.py
(`EagleLlamaForCausalLM`), llama.py / qwen3.py (the decoder layers), and the proposer's contract:

- first step: `combine_hidden_states(target states)`, then `forward(input_ids shifted one left,
  positions, hidden_states)`; with method "eagle3" the target states are the concatenated
  auxiliary states (`hidden + residual` after layer k − 1 for id k, llama.py `_maybe_add_hidden_state`;
  id = num_hidden_layers is the last layer's output before the final norm), with method "eagle"
  the target's output after its final norm;
- `forward` returns (states whose logits are sampled, states fed to the next step);
- chained steps: `forward(drafted token, position + 1, the second element)`;
- `compute_logits` (d2t offsets scatter a draft vocabulary into the target's, −inf elsewhere);
  `embed_tokens` and `lm_head` are swapped for the target's unless the checkpoint has its own
  (`_maybe_share_embeddings` / `_maybe_share_lm_head`).

Loading is strict: a checkpoint name no parameter takes, or a parameter no checkpoint name fills
(other than the embedding and lm_head the proposer shares from the target), is an error.
vLLM's own EAGLE loaders are not: AutoWeightsLoader ignores any unexpected `*.bias`
(vllm/model_executor/models/utils.py `AutoWeightsLoader.load_weights`), and their `load_weights`
return None, which turns off the default loader's missing-weight check
(vllm/model_executor/model_loader/default_loader.py `load_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix, process_eagle_weight

from mtp_train.serving.vllm_plugin import ARCHITECTURES, FORMAT, FORMAT_VERSION, METHODS, STACKED

SHARDS = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}


def checked_block(vllm_config: VllmConfig, variant: str) -> dict:
    """The draft config's `mtp_train` block, refused unless it is this format, version and head
    variant, served by the method that feeds the states the head was trained on."""
    spec = vllm_config.speculative_config
    config = spec.draft_model_config.hf_config
    block = getattr(config, "mtp_train", None)
    where = f"{spec.draft_model_config.model}/config.json"
    if not isinstance(block, dict) or (block.get("format"), block.get("format_version")) != (
        FORMAT,
        FORMAT_VERSION,
    ):
        found = (block or {}).get("format"), (block or {}).get("format_version")
        raise ValueError(
            f"{where}: mtp_train block {found} is not {FORMAT!r} version {FORMAT_VERSION}: "
            "re-export the head with export.formats=[vllm] from this version of mtp-train"
        )
    if block.get("variant") != variant:
        raise ValueError(
            f"{where}: a {block.get('variant')} head, but {ARCHITECTURES[variant]} serves {variant}"
        )
    if spec.method != METHODS[variant]:
        raise ValueError(
            f"{where}: a {variant} head is served with speculative_config method "
            f"{METHODS[variant]!r} (the states it was trained on), not {spec.method!r}"
        )
    if spec.parallel_drafting:
        raise ValueError(f"{where}: a {variant} head drafts a chain; parallel_drafting is not supported")
    return block


class _DraftLlamaLayer(LlamaDecoderLayer):
    def get_quant_config(self, vllm_config):  # the draft's quantization, not the target's
        return get_draft_quant_config(vllm_config)


def decoder_layer(vllm_config: VllmConfig, config, kind: str, prefix: str, input_norm: bool) -> nn.Module:
    """One decoder layer of the target's kind (Llama or Qwen3), as vLLM builds the target's."""
    if kind == "llama":
        layer = _DraftLlamaLayer(vllm_config, prefix=prefix, config=config)
    elif kind == "qwen3":
        layer = Qwen3DecoderLayer(
            config, vllm_config.cache_config, get_draft_quant_config(vllm_config), prefix=prefix
        )
    else:
        raise ValueError(f"mtp_train vLLM plugin: no decoder layer for a {kind!r} target (llama, qwen3)")
    if not input_norm:
        layer.input_layernorm = nn.Identity()  # EAGLE-1: the layer reads fc's output as it is
    return layer


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "input_embeds": 0}
)
class RestoredHead(nn.Module):
    """x = fc([enorm(e); hnorm(h)]); y = layer(x) (input_layernorm kept); returns (norm(y), y)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, h, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        self.enorm, self.hnorm = RMSNorm(h, eps=eps), RMSNorm(h, eps=eps)
        self.fc = ReplicatedLinear(
            2 * h,
            h,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        kind = config.mtp_train["layer_kind"]
        self.layers = nn.ModuleList(
            [decoder_layer(vllm_config, config, kind, maybe_prefix(prefix, f"layers.{start_layer_id}"), True)]
        )
        self.norm = RMSNorm(h, eps=eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_embeds is None:
            input_embeds = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([self.enorm(input_embeds), self.hnorm(hidden_states)], dim=-1))
        out, residual = self.layers[0](positions, x, None)
        z, y = self.norm(out, residual)  # fused: (norm(out + residual), out + residual)
        return z, y


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "input_embeds": 0}
)
class Eagle1Head(nn.Module):
    """x = fc([e; f]) + bias; y = layer(x) without input_layernorm; returns (y, y)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, h, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        self.fc = ReplicatedLinear(
            2 * h,
            h,
            bias=True,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        kind = config.mtp_train["layer_kind"]
        self.layers = nn.ModuleList(
            [
                decoder_layer(
                    vllm_config, config, kind, maybe_prefix(prefix, f"layers.{start_layer_id}"), False
                )
            ]
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_embeds is None:
            input_embeds = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([input_embeds, hidden_states], dim=-1))
        out, residual = self.layers[0](positions, x, None)
        y = out + residual
        return y, y


def load_strictly(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str],
    shared: set[str],
) -> set[str]:
    """Load checkpoint tensors into `model`'s parameters (q/k/v and gate/up fused as vLLM fuses
    them), refusing unknown names and unfilled parameters. `rename`: checkpoint name → parameter
    name; `shared`: parameters the proposer replaces by the target's (reported as loaded)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards: dict[str, set] = {}
    for name, tensor in weights:
        process_eagle_weight(model, name)  # has_own_lm_head where the file has an lm_head
        target = rename(name)
        fused = next(
            ((target.replace(part, whole), whole, shard) for part, whole, shard in STACKED if part in target),
            None,
        )
        pname = fused[0] if fused else target
        if pname not in params:
            raise ValueError(
                f"{type(model).__name__}: checkpoint tensor {name!r} has no parameter ({pname!r}); "
                f"the parameters are {sorted(params)}"
            )
        param = params[pname]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if fused:
            loader(param, tensor, fused[2])
            shards.setdefault(pname, set()).add(fused[2])
            if shards[pname] == SHARDS[fused[1]]:
                loaded.add(pname)
        else:
            loader(param, tensor)
            loaded.add(pname)
    missing = sorted(set(params) - loaded - shared)
    if missing:
        raise ValueError(f"{type(model).__name__}: the checkpoint does not fill {missing}")
    return loaded | (shared & set(params))


def _rename(name: str) -> str:
    """Checkpoint names are the head's (`fc.weight`, `layers.0.…`); the head lives under `model.`,
    lm_head and the draft vocabulary's offsets at the top, as in vLLM's EAGLE-3 class."""
    if name == "d2t":
        return "draft_id_to_target_id"
    return name if name.startswith("lm_head.") else f"model.{name}"


class Eagle3MTPTrainRestoredForCausalLM(Eagle3LlamaForCausalLM):
    """The rmsnorm-restored head, served through vLLM's EAGLE-3 path (method "eagle3") with the
    target's last-layer pre-norm state as its one auxiliary state."""

    supports_pp = False  # a draft lives on the last pipeline stage; it takes no intermediate tensors

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        block = checked_block(vllm_config, "rmsnorm-restored")
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        layers = vllm_config.model_config.get_total_num_hidden_layers()
        aux = list(getattr(config, "eagle_aux_hidden_state_layer_ids", None) or [])
        if aux != [layers]:
            raise ValueError(
                f"{ARCHITECTURES['rmsnorm-restored']}: eagle_aux_hidden_state_layer_ids {aux} must be "
                f"[{layers}] (the last layer's output before the final norm of this {layers}-layer "
                f"target); the head was exported for a target of {block.get('target_layers')} layers"
            )
        config.target_layer_count = layers  # draft-relative layer_types indexing (LlamaAttention)
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        self.model = RestoredHead(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), start_layer_id=layers
        )
        vocab = config.draft_vocab_size
        self.lm_head = ParallelLMHead(
            vocab,
            config.hidden_size,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(vocab, scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = (
            nn.Parameter(torch.zeros(vocab, dtype=torch.long), requires_grad=False)
            if vocab != vllm_config.model_config.get_vocab_size()
            else None
        )
        self.use_parallel_drafting = False

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states  # the one captured state is h itself: hnorm is applied in forward

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        shared = {"model.embed_tokens.weight"}
        if self.draft_id_to_target_id is None:
            shared.add("lm_head.weight")  # the target's; a draft vocabulary's rows are in the file
        return load_strictly(self, weights, _rename, shared)


class EagleMTPTrainEagle1ForCausalLM(EagleLlamaForCausalLM):
    """The eagle1 head (fc with its bias), served through vLLM's EAGLE path (method "eagle"), which
    feeds the target's output after its final norm: f = final_norm(h)."""

    supports_pp = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        checked_block(vllm_config, "eagle1")
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = layers
        self.model = Eagle1Head(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), start_layer_id=layers
        )
        vocab = config.draft_vocab_size
        self.logits_processor = LogitsProcessor(vocab, scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        if vocab != vllm_config.model_config.get_vocab_size():  # its own rows of the target's lm_head
            self.lm_head = ParallelLMHead(
                vocab,
                config.hidden_size,
                quant_config=get_draft_quant_config(vllm_config),
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(vocab, dtype=torch.long), requires_grad=False
            )

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    # logits over the draft vocabulary scattered into the target's (−inf elsewhere), as EAGLE-3's
    compute_logits = Eagle3LlamaForCausalLM.compute_logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_strictly(self, weights, _rename, {"model.embed_tokens.weight"})
