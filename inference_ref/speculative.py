"""Speculative decoding with an MTP draft, batched: the loop validation measures, whose greedy
output must equal the target's own greedy output token for token.

Each step, per row: the draft proposes k tokens (d_1 from its entry for the last committed
position, d_2 … d_k by chaining its own output states), the target scores [last, d_1 … d_k] in one
cached forward, the acceptable prefix of the draft is kept plus one token from the target (the
correction at the first rejection, or the bonus after all k), and both caches commit what was kept.
Rows accept different numbers of tokens, so each cache row advances by its own count.

The draft's shape is a `Chain` of k tokens, or a `tree.TreeShape`: then each step drafts an EAGLE-2
dynamic tree and verifies all its nodes in one forward (`inference_ref.tree`); the rest of the loop
is the same. Both say what a verify processes (`verify_tokens`), what it can accept
(`most_accepted`) and how a report names them (`report_fields`).

With an `SSD` setting (chains), every verify also scores what an asynchronous drafter would have
got (`inference_ref.ssd`): whether the outcome (accepted count, the target's token) is among the
draft's top-F predictions, and, sampled, drafting from Saguaro's reshaped distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from inference_ref.decode_graph import record
from inference_ref.draft import MTPDraft
from inference_ref.generate import (
    append_until_done,
    at_positions,
    draw,
    last_logits,
    prefill,
    probabilities,
    right_pad,
    sample,
)
from inference_ref.ssd import cache_hits
from inference_ref.target import Cache, TargetModel
from inference_ref.tree import TreeShape, TreeStep


@dataclass(frozen=True)
class Chain:
    """A chain of k draft tokens per verify step (d_2 … d_k each drafted from the one before)."""

    k: int

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"a chain of {self.k} draft tokens: k must be ≥ 1")

    @property
    def verify_tokens(self) -> int:
        """Tokens one verify forward processes per row: the last committed token and the k drafted."""
        return self.k + 1

    @property
    def most_accepted(self) -> int:
        """Draft tokens one verify can accept at most."""
        return self.k

    @property
    def cache_room(self) -> int:
        """Cache entries a row needs past prompt + max_new_tokens: an active row has committed
        < prompt + max_new_tokens − 1 entries and writes k + 1 past them; a row that finished may
        have committed k + 1 more, and later steps still write k + 1 past those."""
        return 2 * self.k + 1

    def report_fields(self) -> dict:
        """How a validation report describes the draft."""
        return {"draft": "chain", "k": self.k}


@dataclass(frozen=True)
class SSD:
    """Speculative speculative decoding's outcome prediction, scored at every verify of a chain."""

    fan_outs: tuple[int, ...] = (1, 4, 8, 16)
    """Cache sizes F: tokens predicted per outcome position (hit = the outcome among them)."""
    saguaro_factor: float = 1.0
    """Saguaro sampling (temperature > 0): the draft's top `saguaro_fan_out` + 1 tokens scaled by
    this factor in q' (drafted from and verified against); 1: plain q."""
    saguaro_fan_out: int = 4


@dataclass
class SpecStats:
    """Acceptance counts over (row, step) pairs of active rows, and where the time went."""

    k: int
    """Draft tokens proposed per step (a tree: its depth, the most a step can accept)."""
    tried: list[int] = field(init=False)
    """tried[j-1]: steps in which draft token j (a tree: a node at depth j) was judged (tokens < j all accepted)."""
    accepted: list[int] = field(init=False)
    """accepted[j-1]: steps in which draft token j was accepted."""
    steps: int = 0
    """Target verify forwards, counted per row."""
    emitted: int = 0
    """Tokens those forwards produced (accepted + 1 each; tokens past an EOS or the limit included)."""
    draft_s: float = 0.0
    target_s: float = 0.0
    graphed: bool = False
    """Steps ran as CUDA graph replays: draft_s / target_s then cover the prefills only."""
    iterations: int = 0
    """Loop iterations: one step of every active row each."""
    host_s: float = 0.0
    """The host's work between iterations, from a step's results reaching it to the next step's
    launch (emit, counts, the active rows' copy back): with graphed steps the device waits for it."""
    fan_outs: tuple[int, ...] = ()
    """SSD cache sizes scored (`SSD.fan_outs`); none when SSD was not asked for."""
    hits: list[int] = field(init=False)
    """hits[i]: verify steps whose outcome was in an SSD cache of fan_outs[i] tokens per position."""

    def __post_init__(self):
        self.tried, self.accepted = [0] * self.k, [0] * self.k
        self.hits = [0] * len(self.fan_outs)

    @property
    def hit_rate(self) -> dict[int, float]:
        """fan-out F → the share of verify steps an SSD cache of F tokens per position would have hit."""
        return {f: h / self.steps if self.steps else float("nan") for f, h in zip(self.fan_outs, self.hits)}

    @property
    def host_ms_per_step(self) -> float:
        """`host_s` per interval between iterations, in ms (#36's bar: 0.5 ms)."""
        return 1e3 * self.host_s / (self.iterations - 1) if self.iterations > 1 else float("nan")

    @property
    def accept_rate(self) -> list[float]:
        """accept_rate[j-1]: fraction of steps whose draft token j was accepted given tokens < j were."""
        return [a / t if t else float("nan") for a, t in zip(self.accepted, self.tried)]

    @property
    def mean_accepted_len(self) -> float:
        """τ: tokens emitted per target verify forward, 1 … k+1."""
        return self.emitted / self.steps if self.steps else float("nan")

    def record(self, n_accepted: list[int], active: list[bool], hits: list[list[int]] | None = None) -> None:
        """One step's counts over the active rows (`hits[b]`: row b's SSD hit per fan-out)."""
        n = [a for a, live in zip(n_accepted, active) if live]
        for j in range(self.k):
            self.tried[j] += sum(a >= j for a in n)
            self.accepted[j] += sum(a > j for a in n)
        self.steps += len(n)
        self.emitted += sum(n) + len(n)
        for row in (h for h, live in zip(hits or [], active) if live):
            self.hits = [total + hit for total, hit in zip(self.hits, row)]


@dataclass
class SpecOutput:
    tokens: list[list[int]]
    """New tokens per prompt, up to and including the first EOS."""
    stats: SpecStats
    per_prompt: list[list[int]]
    """Per prompt: [verify steps, tokens emitted, steps whose first draft token was accepted]."""


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    draft: MTPDraft,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    shape: Chain | TreeShape,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    graph: bool = False,
    ssd: SSD | None = None,
) -> SpecOutput:
    """Generate with the target, drafting a `Chain` of k ≥ 1 tokens per verify step or a draft tree
    of `shape` (`inference_ref.tree`, eager); greedy at temperature 0. A `generator` must be on the
    target's device. `graph` (CUDA, greedy, chains): each step is one CUDA graph replay
    (`SpecStep`); the draft/target time split is then not measured. `ssd` (chains): score SSD's
    outcome prediction, which costs one more draft step per verify."""
    device = target.embed_tokens.weight.device
    chain = isinstance(shape, Chain)  # which step runs: `SpecStep` (chains) or `TreeStep`
    if ssd and not chain:
        raise ValueError("SSD outcome prediction is defined for chains, not trees")
    if not draft.chains and (ssd or not chain):
        raise ValueError(
            f"a {draft.spec.variant} head drafts a block per verify, with no chained steps: "
            "trees and SSD's outcome prediction are not defined for it"
        )
    eos = set(eos_ids)
    stats = SpecStats(shape.most_accepted, fan_outs=ssd.fan_outs if ssd else ())
    clock = Clock(device)
    max_len = max(len(p) for p in prompts) + max_new_tokens + shape.cache_room

    with clock.time("target"):
        target_cache, hidden = prefill(target, prompts, max_len, draft.capture)
        last = sample(last_logits(target, hidden, target_cache.lengths), temperature, generator)
    with clock.time("draft"):
        draft_cache, y = draft_prefill(draft, hidden, prompts, last, max_len)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = emit(outputs, [True] * len(prompts), [[0, t] for t in last.tolist()], eos, max_new_tokens)

    use_graph = chain and graph and device.type == "cuda" and temperature == 0 and target.tp_size == 1
    if chain:
        step = SpecStep(
            target, draft, target_cache, draft_cache, shape.k, temperature, generator, clock, use_graph, ssd
        )
    else:
        step = TreeStep(target, draft, target_cache, draft_cache, shape, temperature, generator, clock)
    step.start(last, y, torch.tensor(active, device=device))
    per_prompt = [[0, 0, 0] for _ in prompts]
    synced = None  # when the last step's results reached the host
    while any(active):
        if synced is not None:
            stats.host_s += time.perf_counter() - synced
        kept, n_accepted = step()
        # One copy to the host per step (counts, tokens and SSD hits together): at batch 1 a step
        # is a few milliseconds, and every further synchronization was a visible share of it.
        hits = step.hits if stats.fan_outs else kept[:, :0]
        rows = torch.cat([n_accepted[:, None], hits.long(), kept], 1).tolist()
        synced = time.perf_counter()  # the step is done: what follows until the next one is host work
        stats.iterations += 1
        nh = hits.shape[1]
        stats.record([row[0] for row in rows], active, [row[1 : 1 + nh] for row in rows])
        for b in (b for b, live in enumerate(active) if live):
            n = rows[b][0]
            per_prompt[b] = [per_prompt[b][0] + 1, per_prompt[b][1] + n + 1, per_prompt[b][2] + (n > 0)]
        rows = [row[:1] + row[1 + nh :] for row in rows]
        active = emit(outputs, active, rows, eos, max_new_tokens)
        step.active.copy_(torch.tensor(active))

    stats.draft_s, stats.target_s = clock.total["draft"], clock.total["target"]
    stats.graphed = use_graph
    return SpecOutput(outputs, stats, per_prompt)


class SpecStep:
    """One speculative step for every row: the draft proposes k tokens, the target verifies them
    in one forward, the acceptable prefix plus the target's own token are kept, both caches commit
    them. Its state (the last token, the draft's y, which rows are active) lives in fixed buffers,
    so that with `graph` the whole step is captured once and replayed: at small batches a step is
    hundreds of kernel launches, which the replay turns into one."""

    def __init__(
        self, target, draft, target_cache, draft_cache, k, temperature, generator, clock, graph, ssd=None
    ):
        self.target, self.draft, self.k = target, draft, k
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.temperature, self.generator, self.clock = temperature, generator, clock
        self.graph, self.cuda_graph, self.ssd = graph, None, ssd
        self.hits: torch.Tensor | None = None
        """[B, len(ssd.fan_outs)] after a step with `ssd`: each row's SSD cache hit per fan-out."""

    def start(self, last: torch.Tensor, y: torch.Tensor, active: torch.Tensor) -> None:
        self.last, self.y, self.active = last.clone(), y.clone(), active.clone()
        if self.graph:
            self._capture()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every active row; returns (kept [B, k+1], n_accepted [B])."""
        if self.cuda_graph is None:
            return self._run(self.clock, static=False)
        self.cuda_graph.replay()  # refills the captured outputs in place, `self.hits` among them
        return self.kept, self.n_accepted

    def _run(self, clock: Clock, static: bool) -> tuple[torch.Tensor, torch.Tensor]:
        draft, target, tc, dc, ssd = self.draft, self.target, self.target_cache, self.draft_cache, self.ssd
        with clock.time("draft"):
            reshape = ssd and ssd.saguaro_factor != 1.0 and (ssd.saguaro_fan_out, ssd.saguaro_factor)
            # SSD's outcome "all K accepted" needs the draft's distribution after d_K: one more step
            drafted, q, logits = draft.propose(
                self.y,
                self.last,
                dc,
                self.k,
                self.temperature,
                self.generator,
                static,
                reshape or None,
                bool(ssd),
            )
        with clock.time("target"):
            ids = torch.cat([self.last[:, None], drafted], 1)
            hidden = target.forward_cached(ids, tc, static, draft.capture)  # the states the draft reads too
            n_accepted, last = accept(drafted, target.logits(hidden), q, self.temperature, self.generator)
        if ssd:
            self.hits = torch.stack(
                [cache_hits(logits, drafted, n_accepted, last, f) for f in ssd.fan_outs], 1
            )
        # A row's new tokens: the accepted d_1 … d_n, then the target's token. They are also the
        # tokens that follow the newly committed positions, which the draft's refill reads.
        kept = torch.cat([drafted, last[:, None]], 1).scatter(1, n_accepted[:, None], last[:, None])
        commit = torch.where(self.active, n_accepted + 1, 0)
        tc.lengths += commit
        with clock.time("draft"):
            # Refill from the target's states of the committed positions, over the chain's scratch
            # entries (made from the draft's own states); y at the last one proposes the next d_1.
            self.y.copy_(at_positions(draft.prefill(hidden, kept, dc, static), n_accepted))
            dc.lengths += commit
        self.last.copy_(last)
        return kept, n_accepted

    def _capture(self) -> None:
        # Warm-up on a side stream (allocator, kernel choice) from saved state, then capture. The
        # warm-up's cache writes land past the committed entries (scratch); lengths are restored.
        saved = [t.clone() for t in (self.last, self.y, self.target_cache.lengths, self.draft_cache.lengths)]
        self.cuda_graph, (self.kept, self.n_accepted) = record(
            lambda: self._run(NO_CLOCK, static=True), warmups=1, after_warmups=lambda: self._restore(saved)
        )

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for live, value in zip(
            (self.last, self.y, self.target_cache.lengths, self.draft_cache.lengths), saved
        ):
            live.copy_(value)


def draft_prefill(
    draft: MTPDraft, hidden: torch.Tensor, prompts: list[list[int]], first: torch.Tensor, max_len: int
) -> tuple[Cache, torch.Tensor]:
    """Draft entries for every prompt position; returns the cache and y at each row's last entry.

    The entry at position i reads (h_i, t_{i+1}): the prompt shifted one left, ending with the
    target's first generated token."""
    ids, lengths = right_pad(prompts, first.device)
    next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    next_tokens[torch.arange(len(prompts), device=first.device), lengths - 1] = first
    cache = draft.new_cache(len(prompts), max_len)
    y = draft.prefill(hidden, next_tokens, cache)
    cache.lengths = lengths
    return cache, at_positions(y, lengths - 1)


def accept(
    drafted: torch.Tensor,
    target_logits: torch.Tensor,
    q: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens kept per row [B] (0 … k) and the target's token that follows them [B].

    target_logits [B, k+1, V]: position j scores the token after d_j (after `last` for j = 0)."""
    if temperature == 0:
        # Greedy: keep d_j while it equals the target's argmax; the target's argmax right after the
        # kept prefix is the correction (first mismatch) or the bonus (all k kept).
        best = target_logits.argmax(-1)
        n = prefix_length(drafted == best[:, :-1])
        return n, best.gather(1, n[:, None])[:, 0]
    # Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_j with probability
    # min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from norm(max(0, p_j − q_j));
    # if all k are accepted sample the bonus from p_{k+1}. The output is distributed as p exactly.
    p = probabilities(target_logits, temperature)
    p_d = p[:, :-1].gather(-1, drafted[..., None])[..., 0]
    q_d = q.gather(-1, drafted[..., None])[..., 0]
    u = torch.rand(p_d.shape, generator=generator, device=p.device)
    n = prefix_length(u * q_d < p_d)  # u < p/q; q_d > 0 as d was drawn from q
    # q is zero past the last draft token, so there the residual is p_{k+1}: the bonus.
    q = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    return n, draw(residual(at_positions(p, n), at_positions(q, n)), generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q), unnormalized; p itself where rounding left it all zero (p ≈ q)."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def prefix_length(ok: torch.Tensor) -> torch.Tensor:
    """Leading True count per row of ok [B, k]."""
    return ok.long().cumprod(1).sum(1)


def emit(
    outputs: list[list[int]], active: list[bool], rows: list[list[int]], eos: set[int], max_new_tokens: int
) -> list[bool]:
    """rows[b] = [n_accepted, kept tokens …]: append each active row's first n_accepted + 1 kept
    tokens; returns which rows are still active."""
    still = list(active)
    for b, live in enumerate(active):
        if live:
            n, tokens = rows[b][0], rows[b][1:]
            still[b] = not append_until_done(outputs[b], tokens[: n + 1], eos, max_new_tokens)
    return still


class Clock:
    """Wall time per phase; synchronizes CUDA so queued kernels land in the phase that issued them."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total = {"draft": 0.0, "target": 0.0}

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.total[phase] += time.perf_counter() - start


class _NoClock(Clock):
    """Times nothing: inside a CUDA graph capture a synchronize is not allowed."""

    def __init__(self):
        self.cuda, self.total = False, {"draft": 0.0, "target": 0.0}

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        yield


NO_CLOCK = _NoClock()
