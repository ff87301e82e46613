"""Qwen3-MoE target (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with
a mixture-of-experts MLP — a softmax router over `num_experts`, the top `num_experts_per_tok`
weights renormalized when `norm_topk_prob`, no shared expert — in every layer that is not in
`mlp_only_layers` and falls on `decoder_sparse_step`. The experts run as the DeepSeek module's
stacked grouped matmuls (`deepseek_v2.moe.Experts`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.causal_lm import CausalLM, KVCache, RMSNorm, config_fingerprint
from inference_ref.loading import init_random, read_tensors, safetensors_files
from inference_ref.models import llama, qwen3
from inference_ref.models.deepseek_v2.model import build_model, fuse_experts
from inference_ref.models.deepseek_v2.moe import Experts


@dataclass(frozen=True)
class Qwen3MoeConfig(qwen3.Qwen3Config):
    """Shape of a `Qwen3MoeForCausalLM` checkpoint: Qwen3's fields and the experts'."""

    model_type: ClassVar[str] = "qwen3_moe"

    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    @property
    def n_routed_experts(self) -> int:
        """The experts' count under the name the stacked `Experts` module reads."""
        return self.num_experts

    def is_moe(self, layer: int) -> bool:
        """transformers' rule for a sparse layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, hf: dict) -> Qwen3MoeConfig:
        base = asdict(qwen3.Qwen3Config.from_hf(hf))
        return cls(
            **base,
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_experts=hf["num_experts"]
            if "num_experts" in hf
            else hf["num_local_experts"],  # transformers 5.x's name
            num_experts_per_tok=hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )

    def to_hf(self) -> dict:
        return {
            **super().to_hf(),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": self.model_type,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
        }

    def fingerprint(self) -> str:
        return config_fingerprint({"model_type": self.model_type, **asdict(self)})


class Router(nn.Module):
    """Softmax over the experts in fp32, the top k, renormalized to sum 1 when `norm_topk_prob`."""

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → fp32 weights [T, k] and expert ids [T, k]."""
        probs = F.linear(x.float(), self.weight.float()).softmax(-1)
        weights, ids = probs.topk(self.cfg.num_experts_per_tok, -1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids


class SparseMoE(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """The experts' mix of norm(x), plus `residual` if given (as `llama.MLP`)."""
        if norm is not None:
            x = norm(x)
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, *self.router(flat)).view_as(x)
        return out if residual is None else residual + out


def decoder_layer(cfg: Qwen3MoeConfig, i: int) -> llama.DecoderLayer:
    layer = llama.DecoderLayer(cfg, qwen3.Qwen3Attention)
    if cfg.is_moe(i):
        layer.mlp = SparseMoE(cfg)
    return layer


class Qwen3MoeModel(CausalLM):
    """`Qwen3MoeForCausalLM` with fused attention projections and stacked experts."""

    compilable = False  # compiled layers are not measured on the MoE block (data-dependent shapes)

    def __init__(self, cfg: Qwen3MoeConfig):
        layers = [decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, llama.Rotary(cfg), KVCache)


# ---------------------------------------------------------------------------------------------
# Weights


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: Qwen3MoeConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names → this model's: Llama/Qwen3 attention and norms, the router, the experts
    stacked (per-expert or already stacked in the checkpoint)."""
    out = llama.fuse_hf_state_dict(hf, cfg)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe(i):
            p, q = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
            out[q + "router.weight"] = hf[p + "gate.weight"]
            out.update({q + "experts." + k: v for k, v in fuse_experts(hf, cfg, p + "experts.").items()})
    return out


def hf_state_dict(model: Qwen3MoeModel) -> dict[str, torch.Tensor]:
    """This model's weights under Hugging Face names, one tensor per expert and projection."""
    out = llama.hf_state_dict(model)
    sd = model.state_dict()
    for i in range(model.cfg.num_hidden_layers):
        if model.cfg.is_moe(i):
            p, q = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
            out[p + "gate.weight"] = sd[q + "router.weight"].contiguous()
            for e, (gate_up, down) in enumerate(
                zip(sd[q + "experts.gate_up_proj"], sd[q + "experts.down_proj"])
            ):
                gate, up = gate_up.chunk(2)
                out[f"{p}experts.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{p}experts.{e}.up_proj.weight"] = up.contiguous()
                out[f"{p}experts.{e}.down_proj.weight"] = down.contiguous()
    return out


def load_qwen3_moe(path: str | Path, device="cpu", dtype=torch.float32) -> Qwen3MoeModel:
    """Load a target from a Hugging Face directory (safetensors, read by tensor name)."""
    path = Path(path)
    cfg = Qwen3MoeConfig.from_hf(json.loads((path / "config.json").read_text()))
    hf = read_tensors(path, [n for n in safetensors_files(path) if not n.endswith("rotary_emb.inv_freq")])
    return build_model(cfg, fuse_hf_state_dict(hf, cfg), device, dtype, Qwen3MoeModel)


def random_qwen3_moe(cfg: Qwen3MoeConfig, device="cpu", dtype=torch.float32, seed: int = 0) -> Qwen3MoeModel:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeModel(cfg)
    init_random(model)
    model.to(dtype=dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # routing in fp32, as `placed` keeps it
    return model.eval().requires_grad_(False)


# The heads' layer on a Qwen3-MoE target is Qwen3's dense layer (`intermediate_size` wide): a
# one-layer draft is not served with expert parallelism, and engines' EAGLE heads are dense.
head_layer = qwen3.head_layer
fuse_head_layer = qwen3.fuse_head_layer

# The debug shape: Qwen3's, 2 layers, 8 experts of 32, top 2 renormalized, layer 0 dense.
TINY = {
    **qwen3.TINY,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": (0,),
}
