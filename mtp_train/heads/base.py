"""What every training head shares: the target's frozen tensors, the draft vocabulary, the chained
forward over packed draft positions, and the loss interface. Architecture only.

A head kind's own modules and math come from its registry entry (`HeadSpec.kind.math`, in
`inference_ref.head_spec`, shared with the serving draft); its decoder layer from the subclass
(`MTPHead`: a layer of the target's kind; `Eagle3Head`: EAGLE-3's 2H-input layer).
The embeddings, final norm and lm_head are the target's, frozen, and held as buffers so they are in
no optimizer and no checkpoint. Parameter names are the native export format's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_ref.causal_lm import rms_norm
from inference_ref.head_spec import HeadSpec, Symbolic, draft_ids


class DraftHead(nn.Module):
    """The head being trained: `HeadSpec`'s structure, on the target's frozen shared tensors.
    `draft_ids` [Vd]: the draft vocabulary's target ids, increasing (None: the whole vocabulary)."""

    def __init__(
        self, spec: HeadSpec, frozen: dict[str, torch.Tensor], draft_ids: torch.Tensor | None = None
    ):
        super().__init__()
        self.spec = spec
        for name, module in spec.kind.math.own(spec).items():
            self.add_module(name, module)
        self.layer = self.build_layer(spec)
        self.later_layers = nn.ModuleList(self.build_later_layers(spec))
        self.share(frozen, self.draft_vocabulary(draft_ids, always=spec.kind.always_d2t))
        self.reset_parameters()

    def build_layer(self, spec: HeadSpec) -> nn.Module:
        """The decoder layer: `(x, positions, segments, kv)` → y."""
        raise NotImplementedError

    def build_later_layers(self, spec: HeadSpec) -> list[nn.Module]:
        """Layers stacked after the first (`spec.layers` − 1 of them, for a kind that stacks):
        `(y, positions, segments, kv)` → y. None by default."""
        return []

    @classmethod
    def native_block(cls, spec: HeadSpec) -> tuple[Symbolic, dict[str, int]]:
        """The decoder layer's native names (under `layer.`) and the symbols of their shapes."""
        raise NotImplementedError

    @classmethod
    def native_later_block(cls, spec: HeadSpec) -> Symbolic:
        """A later layer's native names (under `later_layers.<i>.`), shapes in `native_block`'s symbols."""
        return {}

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
        """A final norm starts at the target's final norm (z lives where final_norm(h) does); the
        other norms at one; linears, the router and the stacked experts small."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):  # (EAGLE-3.1's fc_norm.<i>)
                nn.init.ones_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p)
        if isinstance(getattr(self, "norm", None), nn.Module):
            with torch.no_grad():
                self.norm.weight.copy_(self.final_norm_weight)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen final norm, of the last layer's state (the first H columns of widened states)."""
        t = self.spec.target
        return rms_norm(h[..., : t.hidden_size], self.final_norm_weight, t.rms_norm_eps)

    def project(self, state: torch.Tensor, token_ids: torch.Tensor, first: bool) -> torch.Tensor:
        """The layer's input from (state, next token): the target's h (first step) or the head's y."""
        e = F.embedding(token_ids, self.embed_weight).to(state.dtype)
        return self.spec.kind.math.project(self, e, state, self.final_norm, from_target=first)

    def output_state(self, y: torch.Tensor) -> torch.Tensor:
        """z: the state whose logits are taken and that is regressed to final_norm(h_{i+1})."""
        return self.spec.kind.math.output_state(self, y)

    def forward(self, hidden, token_ids, positions, batch, steps: int = 1) -> torch.Tensor:
        """Chained forward over packed draft positions.

        hidden [T, H]: the target's h_i; token_ids [steps, T]: row j holds the token fed at depth
        j + 1 for position i (row 0 is t_{i+1}); positions [T]. Returns y [steps, T, H], pre-norm.
        Step j ≥ 1 reads step j-1's y at the same i, at rope position i + j, and attends to the
        step-0 keys ≤ i plus its own chain's keys (as a draft's KV cache holds them when serving),
        in each layer its own (a stacked head's later layers run after the first at every step).
        """
        kv = [[] for _ in range(1 + len(self.later_layers))]  # per layer, every step's (k, v)
        ys, state = [], hidden
        for j in range(steps):
            x = self.project(state, token_ids[j], first=(j == 0))
            state = self.layer(x, positions + j, batch, kv[0])
            for layer, keys in zip(self.later_layers, kv[1:]):
                state = layer(state, positions + j, batch, keys)
            ys.append(state)
        return torch.stack(ys)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return F.linear(z, self.lm_head_weight.to(z.dtype))
