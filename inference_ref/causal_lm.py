"""The skeleton every target kind shares: embeddings, decoder layers, final norm, lm_head and a
rotary table; the packed forward (precompute) and the cached forward (decode), each optionally with
compiled layers; packing helpers; RMSNorm and the standard per-head KV cache.

Architecture only: no training, no data. Hidden states are returned *before* the final norm,
which is what the store and the draft consume. A target kind (`inference_ref/models/<kind>`)
supplies its layers, its rotary module and its cache type.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from inference_ref.attention import Placement, cache_slots, static_batch, uses_split_kv
from inference_ref.cpu_linear import apply_linear


def eos_token_ids(hf: dict) -> tuple[int, ...]:
    """config.json's `eos_token_id` (one id, a list, or absent) as a tuple."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def config_fingerprint(fields: dict) -> str:
    """A short hash of a target config's fields, recorded in stores and exported heads to match
    them to targets."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32, scale in the input dtype (as the reference implementation does).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class NormedRows(NamedTuple):
    """Rows h of the residual stream from a map that also did the first half of the RMSNorm after
    it (`skinny_linear.project`'s norm_after, `skinny_linear_norm_out`): h · g and h's sums of
    squares over each 16 of its features [features / 16, rows]. The map that takes the normed
    rows (`skinny_linear.project_mlp`, `project_qkv`) scales its sums by each row's 1 / rms, so
    that no norm kernel runs between the two."""

    rows: torch.Tensor
    scaled: torch.Tensor
    squares: torch.Tensor


def residual_stream(h: torch.Tensor | NormedRows) -> torch.Tensor:
    """The rows h themselves, whether or not a map did half of their norm (`NormedRows`)."""
    return h.rows if isinstance(h, NormedRows) else h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Fp32Frequencies(nn.Module):
    """A rotary module whose `inv_freq` buffer stays fp32 whatever the module is cast to:
    `.to(bfloat16)`, `.bfloat16()` and DeepSpeed's bf16 engine would round the frequencies, so a
    head trained or validated in bf16 would rotate by other angles than the fp32 serving code
    (off by a large fraction of a turn at position 4000). Only the device follows the cast."""

    def _apply(self, fn, recurse=True):
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if not kept.is_meta:  # a module built on meta gets its table when materialised
            self.inv_freq = kept.to(self.inv_freq.device)
        return self


@dataclass
class KVCache:
    """Static cache for a batch: row b holds `lengths[b]` committed entries.

    Entries past a row's length are scratch: a verify step writes there, and whatever the
    caller does not commit (rejected draft tokens) is overwritten by the next step. The cache of
    every kind whose attention keeps per-head K/V (`num_key_value_heads` × `head_dim`).
    """

    k: torch.Tensor  # [layers, B, max_len, kv_heads, head_dim]
    v: torch.Tensor
    lengths: torch.Tensor  # [B] int64

    @classmethod
    def empty(cls, cfg, layers: int, batch: int, max_len: int, device, dtype) -> KVCache:
        shape = (layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
            lengths,
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's storage, as its cached forward takes it."""
        return self.k[i], self.v[i]

    def shifted(self, n: int) -> KVCache:
        """The same storage with every row `n` entries longer: a draft's chained step writes
        past the committed entries and sees the ones before it, without committing them."""
        return KVCache(self.k, self.v, self.lengths + n)

    def rows(self, index: torch.Tensor) -> KVCache:
        """A cache of rows `index` only: a batch whose finished rows leave it. The rows move to the
        front of this cache's storage, one layer at a time, and the new cache views them: no second
        copy of the cache is made (this one is not to be used after)."""
        return KVCache(front_rows(self.k, index), front_rows(self.v, index), self.lengths[index])

    def slots(self, new: int, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, new] the next `new` tokens take, and their mask (`attention.cache_slots`)."""
        return cache_slots(self.lengths, self.max_len, new, static)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row b's entries at slots src[b] copied to dst[b] ([B, n]), every layer (`move_slots`)."""
        move_slots(self.k, src, dst)
        move_slots(self.v, src, dst)


def front_rows(storage: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """storage [layers, B, ...]: rows `index` moved to the front in place, one layer at a time (the
    gathered copy is one layer's rows, written back at once); returns the view of those rows."""
    n = len(index)
    for layer in storage:
        layer[:n] = layer[index]
    return storage[:, :n]


def move_slots(storage: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """storage [layers, B, max_len, ...]: row b's entries at slots src[b] copied to slots dst[b].
    A token tree's accepted path goes to consecutive slots this way, so that the cache looks as
    if it had been decoded one token at a time. The sources are read before any is written."""
    rows = torch.arange(storage.shape[1], device=storage.device)[:, None]
    storage[:, rows, dst] = storage[:, rows, src]


class CausalLM(nn.Module):
    """What every target kind shares: embeddings, decoder layers, final norm, lm_head (tied or not)
    and a rotary table; the packed forward (precompute) and the cached forward (decode). A kind
    supplies its layers, its rotary module (called with positions and the activations' dtype)
    and its cache type (whose `layer(i)` gives the arguments of layer i's cached forward)."""

    compilable: ClassVar[bool] = True
    """Whether `compile_layers` is measured for this kind (`load_target` compiles only where it is)."""
    split_kv_attention: ClassVar[bool] = False
    """Whether its layers take a consecutive step without a mask, through
    `attention.split_kv_attention` (`attention.uses_split_kv` says when)."""
    passes_norms: ClassVar[bool] = False
    """Whether its layers' cached forward takes the next layer's input_layernorm (`norm_after`)
    and may return `NormedRows` to the next layer instead of a tensor."""
    tp_size: int = 1
    """Ranks its layers are sharded over (`inference_ref.tensor_parallel`); each keeps 1/tp_size of
    the attention heads and so of the KV cache."""

    def __init__(self, cfg, layers: list[nn.Module], rotary: nn.Module, cache_type):
        super().__init__()
        self.cfg, self.cache_type = cfg, cache_type
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary
        # Plain, immutable flags, so that a copied or pickled model carries no compiled function
        # and shares no state: whether compiling was asked for, and which forwards ("packed",
        # "cached") have compiled and run once, or failed to compile.
        self.compiled_layers = False
        self.compile_proven: frozenset[str] = frozenset()
        self.compile_failed: frozenset[str] = frozenset()

    def compile_layers(self) -> None:
        """Run each layer's forwards through torch.compile (dynamic shapes, one compiled graph per
        forward shared by all layers): the elementwise chains between the matmuls (RMSNorm, rotary,
        SiLU·up, the residual adds) fuse into a few kernels. In the packed forward (precompute)
        attention stays the eager varlen call between two compiled halves; the cached forward
        (decode, verify) is compiled whole, so that a graphed decode step replays a third of the
        kernels (386 instead of 1,256 at the SmolLM2 shape). Each compile takes seconds (5.9 s for
        the packed one at the Llama-3.1-8B shape; the cached one specializes up to about five shape
        variants, 8–17 s in all at SmolLM2), worth it on a long precompute or decode. A forward that
        cannot compile here says so on its first call and runs eager."""
        self.compiled_layers = True
        self.compile_proven, self.compile_failed = frozenset(), frozenset()
        allow_compiled_variants(32)

    def runs_compiled(self, forward: str) -> bool:
        """Whether `forward` ("packed" or "cached") goes through its compiled function."""
        return self.compiled_layers and forward not in self.compile_failed

    def packed_layer(self, layer: nn.Module, *args) -> torch.Tensor:
        return self._layer_call("packed", packed_layer_forward, layer, *args)

    def cached_layer(self, layer: nn.Module, *args) -> torch.Tensor:
        # Every input's dim 0 is the batch; args[0] is x [B, S, H], args[-1] the mask: none where
        # the split-key kernel serves the step, which needs no graph per batch size (flex does).
        if self.runs_compiled("cached") and args[-1] is not None:
            static_batch(*(a for a in args if isinstance(a, torch.Tensor)), compiled=True)
        return self._layer_call("cached", cached_layer_forward, layer, *args)

    def _layer_call(self, forward: str, plain, layer: nn.Module, *args) -> torch.Tensor:
        if not self.runs_compiled(forward):
            return plain(layer, *args)
        if forward in self.compile_proven:  # it compiled and ran once: later errors are real errors
            return compiled(plain)(layer, *args)
        try:
            out = compiled(plain)(layer, *args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (Inductor raises many kinds; eager re-raises a real error)
            # stacklevel 5: past this method, packed_layer/cached_layer, forward_*, inference_mode
            warnings.warn(
                f"compiled {forward} layers unavailable, running them eager: {type(e).__name__}: {e}",
                stacklevel=5,
            )
            # This forward only: the other may have compiled already (the cached forward has ops
            # the packed one has not, e.g. the masked attention over the cache).
            self.compile_failed |= {forward}
            return plain(layer, *args)
        self.compile_proven |= {forward}
        return out

    def runs_split_kv(self, new: int, device_type: str) -> bool:
        """Whether a consecutive step of `new` tokens per row goes through the split-key kernel
        (`attention.uses_split_kv`): a kind whose layers have it, unsharded."""
        compiled = self.runs_compiled("cached")
        return (
            self.split_kv_attention
            and self.tp_size == 1
            and uses_split_kv(new, self.cfg, device_type, compiled)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from pre-norm hidden states, in fp32 (of the last layer's: the first H columns of
        states widened by `capture`)."""
        return apply_linear(self.lm_head, self.norm(hidden[..., : self.cfg.hidden_size])).float()

    @torch.inference_mode()
    def forward_packed(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [T] of B packed sequences → (hidden [T, H] before the final norm,
        logits [len(logits_at), V] for the flat positions asked for, or None). With `capture`
        (layer ids), hidden is widened to [T, (1 + n)·H]: see `widened`."""
        positions = packed_positions(cu_seqlens, input_ids.shape[0])
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        entering = {}  # only the captured states are kept: the others are freed as the forward goes
        for i, layer in enumerate(self.layers):
            if i in capture:
                entering[i] = x
            x = self.packed_layer(layer, x, cos, sin, cu_seqlens, max_len)
        logits = None if logits_at is None else self.logits(x[logits_at])
        return widened(x, entering, capture, len(self.layers)), logits

    def new_cache(self, batch: int, max_len: int):
        w = self.norm.weight  # replicated under tensor parallelism: a plain tensor of the compute dtype
        cfg = self.cfg
        if self.tp_size > 1:  # this rank's heads only
            cfg = dataclasses.replace(cfg, num_key_value_heads=cfg.num_key_value_heads // self.tp_size)
        return self.cache_type.empty(cfg, len(self.layers), batch, max_len, w.device, w.dtype)

    @torch.inference_mode()
    def forward_cached(
        self,
        input_ids: torch.Tensor,
        cache,
        static: bool = False,
        capture: tuple[int, ...] = (),
        placement: Placement | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] placed after each row's committed cache entries → hidden [B, S, H]
        (before the final norm; widened by `capture`, see `widened`). Does not commit: the caller
        advances `cache.lengths` (in place, so that a captured graph sees it). `placement`: the
        nodes of a token tree instead, at its slots, positions and mask (`attention.tree_placement`)."""
        if placement is None:
            slots, mask = cache.slots(input_ids.shape[1], static)
            if self.runs_split_kv(input_ids.shape[1], slots.device.type):
                mask = None  # each token sees the keys up to its own slot (`Placement`)
            placement = Placement(slots, slots, mask)
        slots, mask = placement.slots, placement.mask
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(placement.positions, x.dtype)
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                entering[i] = residual_stream(x)
            x = self.cached_layer(
                layer, x, cos, sin, *cache.layer(i), slots, mask, *self._norm_after(i, mask)
            )
        return widened(x, entering, capture, len(self.layers))

    def _norm_after(self, i: int, mask) -> tuple:
        """The extra argument of layer i's cached forward where the kind's layers hand a tile's
        norm on to the next layer's maps (`passes_norms`): that layer's input_layernorm (None for
        the last, whose state leaves the loop whole). Steps without a mask only (the split-key
        attention's: a masked step's compiled layer marks its tensor inputs per batch size), and
        only while the maps split norms (`skinny_linear.use_linear_kernel`'s tile_norm), so that
        the compiled layer otherwise keeps its one graph (the last layer's None would add one)."""
        from inference_ref.skinny_linear import splits_tile_norms  # it imports this module

        if not (self.passes_norms and mask is None and splits_tile_norms()):
            return ()
        return (self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None,)


def widened(
    last: torch.Tensor, entering: dict[int, torch.Tensor], capture: tuple[int, ...], layers: int
) -> torch.Tensor:
    """The last layer's state, then the states named by `capture` concatenated along features:
    id k is the residual stream entering layer k (0: the embeddings), Hugging Face's
    `hidden_states[k]`, as vLLM and the EAGLE
    reference number EAGLE-3's auxiliary layers. The first H columns stay the last layer's state."""
    if not capture:
        return last
    missing = [k for k in capture if k not in entering]
    if missing:
        raise ValueError(f"capture: {missing} are not layers of this target (ids 0 … {layers - 1})")
    return torch.cat([last] + [entering[k] for k in capture], -1)


def packed_layer_forward(layer: nn.Module, x, cos, sin, cu_seqlens, max_len: int) -> torch.Tensor:
    """One layer's packed forward; the unit `CausalLM.compile_layers` compiles."""
    return layer.forward_packed(x, cos, sin, cu_seqlens, max_len)


def cached_layer_forward(layer: nn.Module, *args) -> torch.Tensor:
    """One layer's cached forward (it writes its new cache entries into the slices it is given);
    the unit `CausalLM.compile_layers` compiles for decoding. Compiled, the cache writes become
    in-place scatters, so a captured decode step still writes the caller's cache."""
    return layer.forward_cached(*args)


def allow_compiled_variants(limit: int) -> None:
    """Let a compiled function hold up to `limit` graphs (Dynamo's default: 8, past which it runs
    eagerly without a word). The cached forward's verify steps compile one graph per batch size
    under FlexAttention (`attention.static_batch`); decoding's batch sizes, token counts and a
    validation's last, smaller batch add up past 8 in one process. Never lowers a larger limit."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(dynamo, name, max(getattr(dynamo, name), limit))


@functools.cache
def compiled(forward):
    """`forward` (`packed_layer_forward` or `cached_layer_forward`) through torch.compile, made once
    per process: it compiles on its first call and is shared by every layer and model."""
    return torch.compile(forward, dynamic=True)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each flat token inside its own sequence."""
    starts = cu_seqlens[:-1]
    lengths = cu_seqlens[1:] - starts
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    return torch.arange(total, device=cu_seqlens.device) - starts[seq_of_token]


def cu_seqlens_of(lengths: list[int], device=None) -> torch.Tensor:
    """Cumulative boundaries [B+1] (int64) of sequences of the given lengths."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.long, device=device)
    out[1:] = torch.tensor(lengths, device=device).cumsum(0)
    return out
