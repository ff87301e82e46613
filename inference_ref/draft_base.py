"""What every serving draft shares: its own KV cache, the prefill/refill of entries made from the
target, chained steps (and a tree's nodes), logits over the target vocabulary, and the tensors it
shares with its target. A head kind's own modules and math come from its registry entry
(`HeadSpec.kind.math`, shared with the training head); its decoder layer from the subclass
(`inference_ref.draft.MTPDraft`: a layer of the target's kind; `inference_ref.eagle3.Eagle3Draft`).

Positions (DESIGN "Chained drafting"): the entry for (h_i, t_{i+1}) sits at cache slot and rope
position i and predicts t_{i+2}; chained step j ≥ 1 from base i sits at slot and position i + j and
sees the committed entries 0 … i plus its own chain's steps 1 … j.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_ref.attention import Placement
from inference_ref.generate import draw, probabilities
from inference_ref.head_spec import SHARED, HeadSpec, draft_ids
from inference_ref.loading import placed
from inference_ref.models import TARGET_KINDS
from inference_ref.skinny_linear import project
from inference_ref.ssd import saguaro
from inference_ref.target import Cache, TargetModel


class Draft(nn.Module):
    """A draft of one decoder layer (a stacking kind's: more after it) sharing embeddings, final
    norm and lm_head with its target."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.spec = spec
        for name, module in spec.kind.math.own(spec).items():
            self.add_module(name, module)
        self.layer, self.rotary, self.cache_type = self.build_layer(spec)
        self.later_layers = nn.ModuleList(self.build_later_layers(spec))
        if spec.draft_vocab_size or spec.kind.always_d2t:
            self.register_buffer("d2t", torch.zeros(spec.vocab, dtype=torch.long))

    def build_layer(self, spec: HeadSpec) -> tuple[nn.Module, nn.Module, type]:
        """The decoder layer (with `forward_cached`), its rotary module and its cache type."""
        raise NotImplementedError

    def build_later_layers(self, spec: HeadSpec) -> list[nn.Module]:
        """Layers after the first (with `forward_cached`), for a kind that stacks them. None by default."""
        return []

    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers whose entering states the draft reads beside the last layer's."""
        return self.spec.aux_layers

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target id of each lm_head row where the head has a draft vocabulary (engines store
        the offsets, `d2t`); None: it scores the whole target vocabulary."""
        return draft_ids(self.d2t) if self.spec.draft_vocab_size else None

    @classmethod
    def from_tensors(cls, spec: HeadSpec, tensors: dict[str, torch.Tensor], target: TargetModel) -> Draft:
        """Build from native-format tensors, on the target's device and in its dtype."""
        weight = target.embed_tokens.weight
        with torch.device("meta"):
            draft = cls(spec)
        state = placed(draft.fuse(tensors), weight.device, weight.dtype)
        draft.load_state_dict(state, strict=True, assign=True)
        draft.rotary = type(draft.rotary)(spec.target).to(
            weight.device
        )  # fp32 frequencies whatever the dtype
        draft.share(target, tensors)
        return draft.eval()

    def share(self, target: TargetModel, tensors: dict[str, torch.Tensor]) -> None:
        """Use the target's embeddings, final norm and lm_head (the same modules, not copies),
        except an embedding or lm_head the head file stores itself ([Vd, H] for a draft
        vocabulary). A draft vocabulary otherwise takes the target lm_head's rows of its tokens."""
        weight = target.embed_tokens.weight
        self.embed_tokens, self.target_norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        if "embed_tokens.weight" in tensors:
            own = tensors["embed_tokens.weight"].to(weight.device, weight.dtype)
            self.embed_tokens = nn.Embedding.from_pretrained(own)
        rows = tensors.get("lm_head.weight")
        if rows is not None:
            rows = rows.to(weight.device, weight.dtype)
        elif self.spec.draft_vocab_size:
            full = target.lm_head.weight
            full = (
                full.full_tensor() if hasattr(full, "full_tensor") else full
            )  # vocab-parallel: gathered once
            rows = full[self.draft_ids]
        if rows is not None:
            self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(rows, requires_grad=False)

    def fuse(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native tensors → this module's state dict (`fuse_head_state`)."""
        return fuse_head_state(tensors, self.spec)

    def new_cache(self, batch: int, max_len: int) -> Cache:
        w = self.fc.weight
        return self.cache_type.empty(self.spec.target, self.spec.layers, batch, max_len, w.device, w.dtype)

    def project(self, state: torch.Tensor, tokens: torch.Tensor, from_target: bool) -> torch.Tensor:
        """fc input from (state, next token): the target's h, or the draft's own y when chained."""
        e = self.embed_tokens(tokens).to(state.dtype)
        return self.spec.kind.math.project(self, e, state, self.target_norm, from_target)

    def run_layer(
        self, x: torch.Tensor, cache: Cache, static: bool = False, placement: Placement | None = None
    ) -> torch.Tensor:
        """The decoder layer on x [B, S, H] placed at the cache's lengths (slot = rope position), or
        where `placement` says (the nodes of a draft tree). `static`: attend over the whole cache,
        masked (fixed shapes, no host sync: CUDA graphs)."""
        if placement is None:
            slots, mask = cache.slots(x.shape[1], static)
            placement = Placement(slots, slots, mask)
        cos, sin = self.rotary(placement.positions, x.dtype)
        y = self.layer.forward_cached(x, cos, sin, *cache.layer(0), placement.slots, placement.mask)
        for i, layer in enumerate(self.later_layers, 1):  # a stacked head's, each with its cache layer
            y = layer.forward_cached(y, cos, sin, *cache.layer(i), placement.slots, placement.mask)
        return y

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
    def chain_nodes(
        self, y: torch.Tensor, tokens: torch.Tensor, cache: Cache, placement: Placement
    ) -> torch.Tensor:
        """Chained steps for several nodes of a draft tree at once: each node's token [B, F] with
        its parent's output y [B, F, H], placed by `placement` (scratch slots; the rope position of
        its depth; a mask that shows it the committed entries, its ancestors and itself, which is
        what `chain` would see on the node's own path). Returns the nodes' y [B, F, H]."""
        return self.run_layer(self.project(y, tokens, from_target=False), cache, placement=placement)

    @torch.inference_mode()
    def propose(
        self,
        y: torch.Tensor,
        last: torch.Tensor,
        cache: Cache,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        static: bool = False,
        saguaro_shape: tuple[int, float] | None = None,
        score_after: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """k draft tokens [B, k] chained from y (the entry of the last committed position, which
        already read `last`), the distributions q [B, k, V] they were drawn from (None when greedy)
        and the draft's logits [B, k, V] ([B, k + 1, V] with `score_after`: also after d_k, one more
        chained step). `saguaro_shape` (fan-out, factor): sampled drafts come from Saguaro's q'."""
        tokens, dists, scores = [], [], []
        for step in range(k):
            if step > 0:
                y = self.chain(y, tokens[-1], cache, step, static)
            logits = self.logits(y)
            token, q, _ = self.drafted(logits[:, None], temperature, generator, saguaro_shape)
            tokens.append(token[:, 0])
            scores.append(logits)
            if q is not None:
                dists.append(q[:, 0])
        if score_after:
            scores.append(self.logits(self.chain(y, tokens[-1], cache, k, static)))
        dists = torch.stack(dists, 1) if dists else None
        return torch.stack(tokens, 1), dists, torch.stack(scores, 1)

    @staticmethod
    def drafted(
        logits: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None,
        saguaro_shape: tuple[int, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Tokens [B, n] from logits [B, n, V]: the argmax (greedy), or a draw from each position's
        q (Saguaro's q' with `saguaro_shape`), returned with q; and the logits."""
        if temperature == 0:
            return logits.argmax(-1), None, logits
        q = probabilities(logits, temperature)
        if saguaro_shape:
            q = saguaro(q, *saguaro_shape)
        return draw(q, generator), q, logits

    chains = True
    """Whether it drafts by chaining steps (draft trees and SSD's extra step need that)."""

    def layer_passes(self, k: int) -> int:
        """Draft decoder-layer forwards per verify step of a chain of k: the refill's, which
        proposes d_1, and k − 1 chained steps, each through every layer."""
        return k * self.spec.layers

    @torch.inference_mode()
    def teacher_forced_logits(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [S, V] of the first draft token at every position of one text: the entry for
        (h_i, t_{i+1}) (hidden [1, S, ·], next_tokens [1, S]) predicts t_{i+2}."""
        cache = self.new_cache(1, hidden.shape[1])
        return self.logits(self.prefill(hidden, next_tokens, cache))[0]

    @torch.inference_mode()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the target vocabulary from output states y: with a draft vocabulary its
        tokens scored, the rest −inf (so that greedy and rejection sampling run unchanged, as
        vLLM maps EAGLE-3 logits)."""
        scores = project(self.lm_head, self.spec.kind.math.output_state(self, y)).float()
        vocab = self.spec.target.vocab_size
        if scores.shape[-1] == vocab:
            return scores
        out = scores.new_full((*scores.shape[:-1], vocab), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, scores)


def fuse_head_state(tensors: dict[str, torch.Tensor], spec: HeadSpec) -> dict[str, torch.Tensor]:
    """Native (unfused) names → this module's: the layer's projections fused as the target's kind
    fuses them (`TargetKind.fuse_head_layer`); fc and the norms keep their names."""
    own = {k: v for k, v in tensors.items() if k not in SHARED}
    layer = {k: v for k, v in own.items() if k.startswith("layer.")}
    rest = {k: v for k, v in own.items() if not k.startswith("layer.")}
    return {**rest, **TARGET_KINDS[spec.target.model_type].fuse_head_layer(layer, spec.target, spec.mlp)}
