"""The DeepSeek-V2 decoder layer and model, and its weights: Hugging Face names ↔ fused and stacked ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from inference_ref.causal_lm import CausalLM, RMSNorm
from inference_ref.loading import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    init_random,
    is_scale,
    placed,
    read_tensors,
    safetensors_files,
)
from inference_ref.models.deepseek_v2.config import DeepseekV2Config, YarnScaling, read_deepseek_v2_config
from inference_ref.models.deepseek_v2.mla import LatentAttention, LatentCache, Rotary
from inference_ref.models.deepseek_v2.moe import DenseMLP, MoE, Router


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward_packed(self, x, cos, sin, cu_seqlens, max_len):
        x = x + self.self_attn.forward_packed(self.input_layernorm(x), cos, sin, cu_seqlens, max_len)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, cache, slots, mask):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(CausalLM):
    """`DeepseekV2ForCausalLM` with fused input projections and stacked experts."""

    compilable = False  # compiled layers are not measured on the MoE block (data-dependent shapes)

    def __init__(self, cfg: DeepseekV2Config):
        layers = [DecoderLayer(cfg, cfg.is_moe(i)) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, Rotary(cfg), LatentCache)


# ---------------------------------------------------------------------------------------------
# Loading: Hugging Face names ↔ this model's fused and stacked ones


def _cat(hf: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([hf[n] for n in names], 0)


def fuse_experts(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config, prefix: str) -> dict[str, torch.Tensor]:
    """Routed experts under `prefix` (`model.layers.N.mlp.experts.`) → stacked gate|up and down.

    Hub checkpoints and `save_pretrained` store one tensor per expert and projection; transformers
    5.x holds them stacked in memory (`experts.gate_up_proj` [E, 2I, H], gate rows first)."""
    if prefix + "gate_up_proj" in hf:
        return {"gate_up_proj": hf[prefix + "gate_up_proj"], "down_proj": hf[prefix + "down_proj"]}
    experts = [f"{prefix}{e}." for e in range(cfg.n_routed_experts)]
    gate_up = [_cat(hf, [e + "gate_proj.weight", e + "up_proj.weight"]) for e in experts]
    down = [hf[e + "down_proj.weight"] for e in experts]
    return {"gate_up_proj": torch.stack(gate_up), "down_proj": torch.stack(down)}


def fuse_layer(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config, i: int) -> dict[str, torch.Tensor]:
    """Layer i's Hugging Face tensors → this model's names (q | kv_a fused, gate | up fused, experts stacked)."""
    return fuse_block(hf, cfg, f"model.layers.{i}.", f"layers.{i}.", cfg.is_moe(i))


def fuse_block(
    hf: dict[str, torch.Tensor], cfg: DeepseekV2Config, p: str, q: str, moe: bool
) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under prefix `p` → this model's names under `q`. A norm the
    checkpoint lacks (an eagle1 head's input_layernorm) stays out."""
    a, m = p + "self_attn.", p + "mlp."
    q_in = "q_a_proj" if cfg.q_lora_rank else "q_proj"
    out = {
        q + "self_attn.q_kv_a_proj.weight": _cat(hf, [f"{a}{q_in}.weight", a + "kv_a_proj_with_mqa.weight"]),
    }
    renamed = ["input_layernorm", "post_attention_layernorm"] + [
        "self_attn." + n for n in ("kv_a_layernorm", "kv_b_proj", "o_proj", "q_a_layernorm", "q_b_proj")
    ]
    out.update({f"{q}{n}.weight": hf[f"{p}{n}.weight"] for n in renamed if f"{p}{n}.weight" in hf})
    shared = m + "shared_experts." if moe else m
    mlp = q + ("mlp.shared_experts." if moe else "mlp.")
    out[mlp + "gate_up_proj.weight"] = _cat(hf, [shared + "gate_proj.weight", shared + "up_proj.weight"])
    out[mlp + "down_proj.weight"] = hf[shared + "down_proj.weight"]
    if moe:
        out[q + "mlp.router.weight"] = hf[m + "gate.weight"]
        if m + "gate.e_score_correction_bias" in hf:  # V3's noaux_tc routing
            out[q + "mlp.router.e_score_correction_bias"] = hf[m + "gate.e_score_correction_bias"]
        experts = fuse_experts(hf, cfg, m + "experts.")
        out.update({q + "mlp.experts." + k: v for k, v in experts.items()})
    return out


def fuse_top(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config) -> dict[str, torch.Tensor]:
    lm_head = hf[EMBED] if cfg.tie_word_embeddings else hf[LM_HEAD]
    return {"embed_tokens.weight": hf[EMBED], "norm.weight": hf[FINAL_NORM], "lm_head.weight": lm_head}


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: DeepseekV2Config) -> dict[str, torch.Tensor]:
    """A whole Hugging Face state dict (per-expert or stacked experts) → this model's names."""
    out = fuse_top(hf, cfg)
    for i in range(cfg.num_hidden_layers):
        out.update(fuse_layer(hf, cfg, i))
    return out


def hf_state_dict(model: DeepseekV2Model, stacked: bool = False) -> dict[str, torch.Tensor]:
    """This model's weights under Hugging Face names: one tensor per expert as in hub checkpoints
    and `save_pretrained`, or `stacked` as transformers 5.x holds them (its `load_state_dict`)."""
    cfg = model.cfg
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    out = {EMBED: sd["embed_tokens.weight"], FINAL_NORM: sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for name, tensor in sd.items():
            if name.startswith(q):
                out.update(_unfuse(p, name[len(q) :], tensor, cfg, stacked))
    return out


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    """A fused gate | up weight → its gate and up rows."""
    return [h.contiguous() for h in t.chunk(2, dim=-2)]


def _unfuse(
    p: str, name: str, t: torch.Tensor, cfg: DeepseekV2Config, stacked: bool
) -> dict[str, torch.Tensor]:
    """One of layer p's tensors (`name` relative to the layer) → its Hugging Face tensors."""
    if name == "self_attn.q_kv_a_proj.weight":
        q_in = "q_a_proj" if cfg.q_lora_rank else "q_proj"
        kv_rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        wq, wkv = (w.contiguous() for w in t.split([t.shape[0] - kv_rows, kv_rows]))
        return {f"{p}self_attn.{q_in}.weight": wq, f"{p}self_attn.kv_a_proj_with_mqa.weight": wkv}
    if name == "mlp.router.weight":
        return {p + "mlp.gate.weight": t}
    if name == "mlp.router.e_score_correction_bias":
        return {p + "mlp.gate.e_score_correction_bias": t}
    if name.startswith("mlp.experts.") and stacked:
        return {p + name: t}
    if name == "mlp.experts.gate_up_proj":
        return {
            f"{p}mlp.experts.{e}.{proj}.weight": w
            for e, expert in enumerate(t)
            for proj, w in zip(("gate_proj", "up_proj"), _halves(expert))
        }
    if name == "mlp.experts.down_proj":
        return {f"{p}mlp.experts.{e}.down_proj.weight": w.contiguous() for e, w in enumerate(t)}
    if name.endswith("gate_up_proj.weight"):
        base = p + name.removesuffix("gate_up_proj.weight")
        gate, up = _halves(t)
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    return {p + name: t}


def build_model(
    cfg: DeepseekV2Config, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32, model_class=None
) -> DeepseekV2Model:
    """Assemble a model (`DeepseekV2Model`, or another MoE kind's `model_class`) from a fused state
    dict without allocating random weights first; routers stay fp32 (`placed`)."""
    with torch.device("meta"):
        model = (model_class or DeepseekV2Model)(cfg)
    model.load_state_dict(placed(state, device, dtype), strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(cfg).to(device)  # fp32 frequencies whatever the weights' dtype
    return model.eval().requires_grad_(False)


def load_deepseek_v2(
    path: str | Path, device="cpu", dtype=torch.float32, config_class=None
) -> DeepseekV2Model:
    """Load a target from a Hugging Face directory (safetensors only, read by tensor name); the
    config read as `config_class` (a DeepSeek kind's: V2 unless given)."""
    path = Path(path)
    if config_class is None:
        cfg = read_deepseek_v2_config(path)
    else:
        cfg = config_class.from_hf(json.loads((path / "config.json").read_text()))
    names = list(safetensors_files(path))
    top = [EMBED, FINAL_NORM] + ([] if cfg.tie_word_embeddings else [LM_HEAD])
    state = placed(fuse_top(read_tensors(path, top), cfg), device, dtype)
    for i in range(cfg.num_hidden_layers):
        # One layer at a time, placed before the next is read: host memory holds one layer's
        # tensors (about 1.2 GB for V2-Lite), not the 31 GB checkpoint and its fused copy.
        prefix = f"model.layers.{i}."
        layer = read_tensors(path, [n for n in names if n.startswith(prefix) and not is_scale(n)])
        state.update(placed(fuse_layer(layer, cfg, i), device, dtype))
    return build_model(cfg, state, device, dtype)


def random_deepseek_v2(
    cfg: DeepseekV2Config, device="cpu", dtype=torch.float32, seed: int = 0
) -> DeepseekV2Model:
    """Random weights at a given shape (benchmarks, tiny test targets), made on `device` in
    `dtype` directly: V2-Lite's 15.7B parameters would take minutes to initialise on the host."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV2Model(cfg).to(dtype)
    model.to_empty(device=device)
    init_random(model)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # as `placed` keeps it: routing in fp32, as transformers does
    model.rotary = Rotary(cfg).to(device)  # to_empty left its table uninitialised
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# A draft head's layer of this kind (inference_ref.draft builds it through the registry)


def head_layer(cfg: DeepseekV2Config, mlp: str) -> tuple[nn.Module, nn.Module, type]:
    """The serving head's MLA decoder layer (attending in the latent space, as the target's decode
    does) with a dense MLP `intermediate_size` wide or the target's MoE block; rotary and cache."""
    return DecoderLayer(cfg, moe=mlp == "moe"), Rotary(cfg), LatentCache


def fuse_head_layer(
    tensors: dict[str, torch.Tensor], cfg: DeepseekV2Config, mlp: str
) -> dict[str, torch.Tensor]:
    """A native head's `layer.*` tensors (checkpoint names, experts stacked) → the serving layer's."""
    return fuse_block(tensors, cfg, "layer.", "layer.", moe=mlp == "moe")


# The debug shape: V2-Lite's structure shrunk: full-rank q, a dense layer 0 then MoE, untied lm_head,
# and YaRN with mscale ≠ mscale_all_dim so both its factors (on cos/sin and on the softmax) are ≠ 1.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    rope_scaling=YarnScaling(4.0, 1024, mscale=1.0, mscale_all_dim=0.707),
)
