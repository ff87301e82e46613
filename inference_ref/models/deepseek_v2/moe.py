"""DeepSeek feed-forward blocks: the dense SwiGLU MLP, the router and the grouped-matmul mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.models.deepseek_v2.config import DeepseekV2Config


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """The gate: per token the top-k experts and their weights. Runs in fp32 (the loader keeps its
    weight fp32, as transformers does): a bf16 gate flips near-tied expert choices.

    `greedy` / `group_limited_greedy` (V2): softmax scores, top-k over all experts or within the
    `topk_group` groups holding the best single experts. `noaux_tc` (V3): sigmoid scores; experts are
    chosen on scores + `e_score_correction_bias` (a buffer balancing load without an auxiliary loss)
    within the `topk_group` groups whose two best experts sum highest, weighted by the uncorrected
    scores, renormalized when `norm_topk_prob`. Both × `routed_scaling_factor`."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → fp32 weights [T, k] and expert ids [T, k]."""
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        if c.topk_method == "noaux_tc":
            return self._noaux(logits)
        scores = logits.softmax(-1)
        if c.topk_method == "group_limited_greedy":
            # Keep the topk_group groups holding the best-scoring experts; zero the others.
            groups = scores.unflatten(-1, (c.n_group, -1))
            best = groups.amax(-1).topk(c.topk_group, -1, sorted=False).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(-1, best, True)
            scores = groups.masked_fill(~keep[..., None], 0.0).flatten(-2)
        weights, ids = scores.topk(c.num_experts_per_tok, -1, sorted=False)
        return weights * c.routed_scaling_factor, ids

    def _noaux(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = logits.sigmoid()
        choice = (scores + self.e_score_correction_bias.float()).unflatten(-1, (c.n_group, -1))
        best = choice.topk(2, -1).values.sum(-1).topk(c.topk_group, -1, sorted=False).indices
        keep = torch.zeros_like(choice[..., 0], dtype=torch.bool).scatter(-1, best, True)
        ids = (
            choice.masked_fill(~keep[..., None], float("-inf"))
            .flatten(-2)
            .topk(c.num_experts_per_tok, -1, sorted=False)
            .indices
        )
        weights = scores.gather(-1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_grouped_failed: str | None = None  # why the grouped kernel was given up on, once, if it was


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, rows ends[e-1] … ends[e] − 1 going to expert e; weight
    [E, out, in] → [N, out]. One grouped-GEMM kernel where torch has one for this device and
    dtype: no host sync, so a decode step stays capturable as a CUDA graph."""
    global _grouped_failed
    if _GROUPED_MM is not None and _grouped_failed is None:
        try:
            return _GROUPED_MM(x, weight.transpose(-2, -1), offs=ends)
        except torch.OutOfMemoryError:
            raise  # a property of this batch (a training step's, say), not of the kernel
        except (RuntimeError, NotImplementedError) as e:
            # An older build, or a dtype / alignment its kernel lacks: fall back for good.
            _grouped_failed = f"{type(e).__name__}: {e}"
    return grouped_linear_loop(x, weight, ends)


def grouped_linear_loop(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The same as `grouped_linear`, one matmul per expert that received rows (one host sync)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].T
        start = end
    return out


def grouped_kernel() -> str:
    """Which routed-expert matmul `grouped_linear` uses (reported by benchmarks)."""
    if _GROUPED_MM is None or _grouped_failed is not None:
        return f"one matmul per expert ({_grouped_failed or 'no grouped_mm in this torch'})"
    return "grouped_mm"


class Experts(nn.Module):
    """The routed experts, stacked: gate|up [E, 2I, H] (fused as in the dense MLP), down [E, H, I]."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, linear=grouped_linear):
        """x [T, H], weights/ids [T, k] → Σ_k weight · expert(x) [T, H]."""
        k = ids.shape[1]
        # Sort the T·k (token, expert) pairs by expert so each expert's rows are contiguous.
        order = ids.flatten().argsort(stable=True)
        experts = torch.arange(self.gate_up_proj.shape[0], device=ids.device)
        ends = torch.searchsorted(ids.flatten()[order], experts, right=True).to(torch.int32)
        gate, up = linear(x[order // k], self.gate_up_proj, ends).chunk(2, dim=-1)
        out = linear(F.silu(gate) * up, self.down_proj, ends)
        # Back to (token, slot) order and a fixed-order sum over the k slots: deterministic,
        # unlike an index_add of T·k rows.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        weighted = unsorted.view(*ids.shape, -1).float() * weights[..., None]
        return weighted.sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = self.experts(flat, *self.router(flat))
        return routed.view_as(x) + self.shared_experts(x)
