"""The draft head for training: architecture only (no optimizer, launcher or logging here).

Its structure and math are `inference_ref.head_spec`'s (one description for training, serving and
export). `layer` is one decoder layer of the target's kind, trained over packed chained steps:
its attention comes from the kind's module here (`LAYER_KINDS`), by default with a dense SwiGLU MLP
of the target's `intermediate_size`, or with `mlp="moe"` the target's MoE block.

The embeddings, final norm and lm_head are the target's, frozen, and held as buffers so they
are in no optimizer and no checkpoint. Parameter names are the native export format's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.causal_lm import RMSNorm, rms_norm
from inference_ref.head_spec import HeadSpec, draft_ids, output_state, project
from inference_ref.target import TargetConfig
from mtp_train.head_attention import Segments
from mtp_train.heads.kinds import LAYER_KINDS
from mtp_train.heads.llama import HeadMLP


def head_mlp(cfg: TargetConfig, mlp: str) -> nn.Module:
    if mlp == "moe":
        return LAYER_KINDS[cfg.model_type].moe(cfg)
    return HeadMLP(cfg.hidden_size, cfg.intermediate_size)


class HeadLayer(nn.Module):
    """One decoder layer of the target's kind; eagle1 drops the input norm."""

    def __init__(self, cfg: TargetConfig, input_norm: bool, mlp: str = "dense"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = LAYER_KINDS[cfg.model_type].attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = head_mlp(cfg, mlp)

    def forward(self, x, positions, batch: Segments, kv: list):
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPHead(nn.Module):
    """The head being trained: `HeadSpec`'s structure, on the target's frozen shared tensors."""

    def __init__(
        self, spec: HeadSpec, frozen: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None
    ):
        super().__init__()
        t = spec.target
        self.spec = spec
        h = t.hidden_size
        if spec.restored:
            self.enorm = RMSNorm(h, t.rms_norm_eps)
            self.hnorm = RMSNorm(h, t.rms_norm_eps)
            self.norm = RMSNorm(h, t.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=spec.kind.fc_bias)
        self.layer = HeadLayer(t, input_norm=spec.restored, mlp=spec.mlp)
        self.share(frozen, self.draft_vocabulary(draft_ids, always=False))
        self.reset_parameters()

    def draft_vocabulary(self, draft_ids: torch.Tensor | None, always: bool) -> torch.Tensor | None:
        """Record the draft vocabulary (`draft_ids` [Vd], increasing target ids) as `d2t`, the
        offsets the engines store (target id = draft id + d2t[draft id]), persistent: it is the
        head's. Returns the lm_head rows to keep (None: all). `always`: a kind whose format holds
        d2t even for the whole vocabulary (eagle3)."""
        spec = self.spec
        if draft_ids is None and spec.draft_vocab_size:
            raise ValueError(
                f"a head with a draft vocabulary (model.draft_vocab_size={spec.vocab}) needs its token "
                "ids: the store's most frequent tokens"
            )
        ids = torch.arange(spec.vocab) if draft_ids is None else draft_ids.long()
        if ids.shape != (spec.vocab,):
            raise ValueError(f"draft ids: {tuple(ids.shape)}, expected ({spec.vocab},)")
        if spec.draft_vocab_size or always:
            self.register_buffer("d2t", ids - torch.arange(spec.vocab))
        return ids if spec.draft_vocab_size else None

    def share(self, frozen: dict[str, torch.Tensor], lm_head_rows: torch.Tensor | None = None) -> None:
        """The target's embeddings, final norm and lm_head (its `lm_head_rows` only, for a draft
        vocabulary) as buffers: in no optimizer and no checkpoint."""
        lm_head = frozen["lm_head.weight"]
        self.register_buffer("embed_weight", frozen["model.embed_tokens.weight"], persistent=False)
        self.register_buffer("final_norm_weight", frozen["model.norm.weight"], persistent=False)
        rows = lm_head if lm_head_rows is None else lm_head[lm_head_rows]
        self.register_buffer("lm_head_weight", rows, persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target id of each lm_head row, where the head has a draft vocabulary (else None)."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else draft_ids(d2t)

    def reset_parameters(self) -> None:
        """Norms start at the target's final norm (z lives where final_norm(h) does); linears, the
        router and the stacked experts small."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p)
        if self.spec.restored:
            with torch.no_grad():
                self.norm.weight.copy_(self.final_norm_weight)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen final norm, of the last layer's state (the first H columns of widened states)."""
        t = self.spec.target
        return rms_norm(h[..., : t.hidden_size], self.final_norm_weight, t.rms_norm_eps)

    def project(self, state: torch.Tensor, token_ids: torch.Tensor, first: bool) -> torch.Tensor:
        """fc input from (state, next token). `state` is the target's h (first step) or the head's y."""
        e = F.embedding(token_ids, self.embed_weight).to(state.dtype)
        return project(self, e, state, self.final_norm, from_target=first)

    def output_state(self, y: torch.Tensor) -> torch.Tensor:
        """z: the state whose logits are taken and that is regressed to final_norm(h_{i+1})."""
        return output_state(self, y)

    def forward(self, hidden, token_ids, positions, batch, steps: int = 1) -> torch.Tensor:
        """Chained forward over packed draft positions.

        hidden [T, H]: the target's h_i; token_ids [steps, T]: row j holds the token fed at depth
        j + 1 for position i (row 0 is t_{i+1}); positions [T]. Returns y [steps, T, H], pre-norm.
        Step j ≥ 1 reads step j-1's y at the same i, at rope position i + j, and attends to the
        step-0 keys ≤ i plus its own chain's keys (as a draft's KV cache holds them when serving).
        """
        kv, ys, state = [], [], hidden
        for j in range(steps):
            x = self.project(state, token_ids[j], first=(j == 0))
            state = self.layer(x, positions + j, batch, kv)
            ys.append(state)
        return torch.stack(ys)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return F.linear(z, self.lm_head_weight.to(z.dtype))
