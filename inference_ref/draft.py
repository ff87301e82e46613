"""The MTP draft head for serving: loads the native export and runs it through its own KV cache.

The decoder layer is the target's kind: a Llama layer with a KV cache, or for a DeepSeek-V2
target an MLA layer with a latent cache, attending in the latent space as the target's decode
does, and a dense MLP or (config.json `"mlp": "moe"`) the target's MoE block.

Math (the training module `mtp_train.heads.MTPHead` is the contract this reproduces):

rmsnorm-restored:  x = fc([enorm(embed(t)); hnorm(s)]);  y = layer(x);  logits = lm_head(norm(y))
eagle1:            x = fc([embed(t); f]) + bias, f = final_norm(h) from the target, f = y when chained;
                   y = layer(x) without input_layernorm;  logits = lm_head(y)

`s` is the target's pre-norm state h_i for an entry made from the target, or the draft's own y
for a chained step. Positions (DESIGN "Chained drafting"): the entry for (h_i, t_{i+1}) sits at
cache slot and rope position i and predicts t_{i+2}; chained step j ≥ 1 from base i sits at slot
and position i + j and sees the committed entries 0 … i plus its own chain's steps 1 … j.

Native format: a directory with `head.safetensors` (the training module's parameter names,
unfused) and `config.json` (`format: mtp-train-head`, see `HeadSpec.from_config`). Embeddings,
final norm and lm_head are the target's unless the file stores `embed_tokens.weight` /
`lm_head.weight`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from inference_ref import deepseek_v2 as ds
from inference_ref.config import LlamaConfig
from inference_ref.deepseek_v2 import LatentCache
from inference_ref.llama import DecoderLayer, KVCache, RMSNorm, Rotary
from inference_ref.target import Cache, TargetConfig, TargetModel, config_from_hf

FORMAT, FORMAT_VERSION = "mtp-train-head", 1
ARCHITECTURES = {
    LlamaConfig.model_type: "LlamaMTPHead",
    ds.DeepseekV2Config.model_type: "DeepseekV2MTPHead",
}  # by target kind
VARIANTS = ("rmsnorm-restored", "eagle1")
MLPS = ("dense", "moe")  # the layer's MLP; a config.json without "mlp" (older heads) is dense
SHARED = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class HeadSpec:
    """What `config.json` says about the head's shape."""

    variant: str
    """`rmsnorm-restored` or `eagle1`."""
    layer: TargetConfig
    """Shape of the head's one decoder layer (the target's kind)."""
    mlp: str = "dense"
    """The layer's MLP: `dense`, or `moe` (the target's MoE block; DeepSeek-V2 targets only)."""

    @property
    def restored(self) -> bool:
        return self.variant == "rmsnorm-restored"

    @classmethod
    def from_config(cls, config: dict) -> HeadSpec:
        if (config.get("format"), config.get("format_version")) != (FORMAT, FORMAT_VERSION):
            raise ValueError(
                f"head config.json: format {config.get('format')!r} version {config.get('format_version')!r}"
                f" is not {FORMAT!r} version {FORMAT_VERSION}"
            )
        layer = config_from_hf(config["layer_config"])
        expected = ARCHITECTURES[layer.model_type]
        if config.get("architecture") != expected or config.get("variant") not in VARIANTS:
            raise ValueError(
                f"head config.json: architecture {config.get('architecture')!r} variant "
                f"{config.get('variant')!r} is not {expected!r} with a variant in {VARIANTS}"
            )
        mlp = config.get("mlp", "dense")
        check_mlp(mlp, layer.model_type, "head config.json: mlp")
        return cls(config["variant"], layer, mlp)


def check_mlp(mlp: str, kind: str, field: str) -> None:
    """The head layer's MLP option, checked alike where a head is trained (`model.head_mlp`) and
    where it is served (config.json's `mlp`): `moe` needs a target kind whose layers have experts."""
    if mlp not in MLPS:
        raise ValueError(f"{field}: {mlp!r} is not one of {MLPS}")
    if mlp == "moe" and kind != ds.DeepseekV2Config.model_type:
        raise ValueError(
            f"{field}: 'moe' builds the target's MoE block, but this target is {kind}, "
            "whose layers have no experts: use 'dense'"
        )


def check_head_fits_target(config: dict, target: TargetConfig, where: str = "head") -> None:
    """A head reads the target's hidden states and proposes the target's token ids, with a layer of
    the target's kind: kind and sizes must match (checked before anything large is loaded)."""
    kind = config["layer_config"].get("model_type")
    if kind != target.model_type:
        raise ValueError(
            f"{where} is a {config.get('architecture')} for a {kind} target, this target is "
            f"{target.model_type}: it was trained for another kind of target"
        )
    for key in ("hidden_size", "vocab_size"):
        if config[key] != getattr(target, key):
            raise ValueError(
                f"{where} has {key} {config[key]}, this target has {getattr(target, key)}: "
                "it was trained for another target"
            )


def fuse_head_state(tensors: dict[str, torch.Tensor], spec: HeadSpec) -> dict[str, torch.Tensor]:
    """Native (unfused) names → this module's, concatenating the projections that read the layer's
    input (q|k|v, or DeepSeek's q|kv_a) and gate|up (of the dense MLP or the shared experts), as
    the target does. An MoE head's stacked experts already have the serving names."""
    out = {k: v for k, v in tensors.items() if k not in SHARED}
    layer = spec.layer
    if layer.model_type == ds.DeepseekV2Config.model_type:
        fused, parts = "q_kv_a_proj", ["q_a_proj" if layer.q_lora_rank else "q_proj", "kv_a_proj_with_mqa"]
    else:
        fused, parts = "qkv_proj", ["q_proj", "k_proj", "v_proj"]
    attn = [out.pop(f"layer.self_attn.{n}.weight") for n in parts]
    out[f"layer.self_attn.{fused}.weight"] = torch.cat(attn, 0)
    mlp = "layer.mlp.shared_experts." if spec.mlp == "moe" else "layer.mlp."
    gate_up = [out.pop(mlp + "gate_proj.weight"), out.pop(mlp + "up_proj.weight")]
    out[mlp + "gate_up_proj.weight"] = torch.cat(gate_up, 0)
    if spec.mlp == "moe":
        out["layer.mlp.router.weight"] = out.pop("layer.mlp.gate.weight")
    return out


class MTPDraft(nn.Module):
    """One-layer draft head sharing embeddings, final norm and lm_head with its target."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.spec = spec
        h, eps = spec.layer.hidden_size, spec.layer.rms_norm_eps
        if spec.restored:
            self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=not spec.restored)
        self.layer, self.rotary, self.cache_type = layer_of_kind(spec)
        if not spec.restored:
            self.layer.input_layernorm = nn.Identity()

    @classmethod
    def from_tensors(cls, spec: HeadSpec, tensors: dict[str, torch.Tensor], target: TargetModel) -> MTPDraft:
        """Build from native-format tensors, on the target's device and in its dtype."""
        weight = target.embed_tokens.weight
        with torch.device("meta"):
            draft = cls(spec)
        state = ds.placed(fuse_head_state(tensors, spec), weight.device, weight.dtype)
        draft.load_state_dict(state, strict=True, assign=True)
        draft.rotary = type(draft.rotary)(spec.layer).to(weight.device)  # fp32 frequencies whatever the dtype
        draft.share(target, tensors)
        return draft.eval()

    def share(self, target: TargetModel, tensors: dict[str, torch.Tensor]) -> None:
        """Use the target's embeddings, final norm and lm_head (the same modules, not copies),
        except an embedding or lm_head the head file stores itself."""
        weight = target.embed_tokens.weight
        self.embed_tokens, self.target_norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        if "embed_tokens.weight" in tensors:
            own = tensors["embed_tokens.weight"].to(weight.device, weight.dtype)
            self.embed_tokens = nn.Embedding.from_pretrained(own)
        if "lm_head.weight" in tensors:
            self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(tensors["lm_head.weight"].to(weight.device, weight.dtype))

    def new_cache(self, batch: int, max_len: int) -> Cache:
        w = self.fc.weight
        return self.cache_type.empty(self.spec.layer, 1, batch, max_len, w.device, w.dtype)

    def project(self, state: torch.Tensor, tokens: torch.Tensor, from_target: bool) -> torch.Tensor:
        """fc input from (state, next token): the target's h, or the draft's own y when chained."""
        e = self.embed_tokens(tokens).to(state.dtype)
        if self.spec.restored:
            return self.fc(torch.cat([self.enorm(e), self.hnorm(state)], -1))
        # eagle1 reads features f = final_norm(h); its own y already lives in that space.
        f = self.target_norm(state) if from_target else state
        return self.fc(torch.cat([e, f], -1))

    def run_layer(self, x: torch.Tensor, cache: Cache, static: bool = False) -> torch.Tensor:
        """The decoder layer on x [B, S, H] placed at the cache's lengths (slot = rope position).
        `static`: attend over the whole cache, masked (fixed shapes, no host sync: CUDA graphs)."""
        slots, mask = cache.slots(x.shape[1], static)
        cos, sin = self.rotary(slots, x.dtype)
        return self.layer.forward_cached(x, cos, sin, *cache.layer(0), slots, mask)

    @torch.inference_mode()
    def prefill(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: Cache, static: bool = False
    ) -> torch.Tensor:
        """Entries for target states h_i [B, S, H] (pre-norm) and tokens t_{i+1} [B, S], written at
        the cache's lengths; also the refill after each verification. Does not commit: the caller
        advances `cache.lengths`. Returns the output states y [B, S, H]."""
        return self.run_layer(self.project(hidden, next_tokens, from_target=True), cache, static)

    @torch.inference_mode()
    def chain(
        self, y: torch.Tensor, token: torch.Tensor, cache: Cache, step: int, static: bool = False
    ) -> torch.Tensor:
        """Chained step `step` ≥ 1 from the last committed entry: reads the previous step's output
        y [B, H] and the token it drafted [B]; writes at slot `lengths − 1 + step` (scratch, never
        committed), seeing the committed entries and this chain's earlier steps. Returns y [B, H]."""
        ahead = cache.shifted(step - 1)
        x = self.project(y[:, None], token[:, None], from_target=False)
        return self.run_layer(x, ahead, static)[:, 0]

    @torch.inference_mode()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 logits from output states y."""
        z = self.norm(y) if self.spec.restored else y
        return self.lm_head(z).float()


def layer_of_kind(spec: HeadSpec) -> tuple[nn.Module, nn.Module, type]:
    """The head's decoder layer, rotary table and cache type, of the target's kind. A DeepSeek-kind
    head's MLP is dense (`intermediate_size` wide) or the target's MoE block, as `mtp_train.heads`
    trains it."""
    cfg = spec.layer
    if cfg.model_type == ds.DeepseekV2Config.model_type:
        return ds.DecoderLayer(cfg, moe=spec.mlp == "moe"), ds.Rotary(cfg), LatentCache
    return DecoderLayer(cfg), Rotary(cfg), KVCache


def load_draft(path: str | Path, target: TargetModel) -> MTPDraft:
    """Load a native-format head directory for `target`, refusing one made for another shape."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    spec = HeadSpec.from_config(config)
    check_head_fits_target(config, target.cfg)
    tensors = load_file(str(path / "head.safetensors"))
    for name, shared in config.get("shared_with_target", {}).items():
        if not shared and f"{name}.weight" not in tensors:
            raise ValueError(f"{path}: config.json says {name} is not shared, but head.safetensors lacks it")
    return MTPDraft.from_tensors(spec, tensors, target)
