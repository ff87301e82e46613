"""EAGLE-2 dynamic draft trees (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees", arXiv:2406.16858), batched: drafting, one verify forward, acceptance.

Per step and row, from the root (the last committed token, and the draft's y at the last committed
position, exactly where a chain starts):

1. grow: the draft scores the root's children and keeps its top_k (depth 1). At each further depth
   the top_k nodes of the newest depth, by cumulative draft log-probability (the draft's estimate
   of the probability that the whole path is accepted), run as chained draft steps in one forward
   with a tree mask, and each scores its top_k children. Every scored node joins a pool; the
   `nodes` best of the pool are verified. They form a tree: a child never scores above its parent,
   and on a tie the parent, scored first, ranks first.
2. verify: the target runs the root and the N nodes in one cached forward, each at rope position
   committed length + depth, seeing the committed entries, its ancestors and itself (`Placement`).
3. accept: the longest acceptable path (greedy, or sampled by recursive rejection over siblings,
   `accept_sampled`), plus one token of the target's. The path's K/V entries move to consecutive
   slots, and the draft refills its cache from the target's states along it, as the chain loop does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_ref.attention import tree_placement
from inference_ref.draft import MTPDraft
from inference_ref.generate import at_positions, draw, probabilities
from inference_ref.target import Cache, TargetModel


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's budget (the other draft shape is `speculative.Chain`)."""

    depth: int
    """Most draft tokens on one path (the draft runs depth − 1 chained forwards per step)."""
    top_k: int
    """Children scored per expanded node, and nodes expanded per depth."""
    nodes: int
    """Draft nodes the target verifies: a verify forward processes nodes + 1 tokens (the root's too)."""

    def __post_init__(self):
        if min(self.depth, self.top_k, self.nodes) < 1 or self.nodes > self.pool:
            raise ValueError(
                f"tree of depth {self.depth}, top_k {self.top_k}, {self.nodes} nodes: each must be ≥ 1 "
                f"and nodes ≤ {self.pool} (the nodes drafting scores)"
            )

    @property
    def pool(self) -> int:
        """Nodes drafting scores: top_k at depth 1, top_k² at each further depth."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def scratch(self) -> int:
        """Cache slots a step writes past a row's committed entries, in either cache."""
        return max(self.nodes + 1, (self.depth - 1) * self.top_k, self.depth + 1)

    @property
    def verify_tokens(self) -> int:
        """Tokens one verify forward processes per row: the root (the last committed token) and the nodes."""
        return self.nodes + 1

    @property
    def most_accepted(self) -> int:
        """Draft tokens one verify can accept at most: one path, the tree's depth."""
        return self.depth

    @property
    def cache_room(self) -> int:
        """Cache entries a row needs past prompt + max_new_tokens (as `speculative.Chain.cache_room`):
        a step commits up to depth + 1 and writes `scratch` past its committed entries."""
        return self.depth + 1 + self.scratch

    def report_fields(self) -> dict:
        """How a validation report describes the draft."""
        return {"draft": "tree", "depth": self.depth, "top_k": self.top_k, "nodes": self.nodes}


@dataclass
class DraftTree:
    """The tokens of one verify forward per row: the root at 0, then the nodes, parents first."""

    tokens: torch.Tensor
    """[B, S] (S = nodes + 1)."""
    parents: torch.Tensor
    """[B, S]: the position of each node's parent (the root's: 0, itself)."""
    depths: torch.Tensor
    """[B, S]: draft tokens from the root to the node (the root: 0)."""
    sees: torch.Tensor
    """[B, S, S]: sees[b, i, j] when j is i or an ancestor of i."""
    scores: torch.Tensor
    """[B, S]: the draft's log-probability of the path to each node (the root: 0)."""


# --- drafting ------------------------------------------------------------------------------------


def draft_log_probs(draft: MTPDraft, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft's log-probabilities [..., V] from its output states: what nodes are ranked by (at
    the sampling temperature, where the target is sampled at one)."""
    logits = draft.logits(y)
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)


@torch.inference_mode()
def grow(
    draft: MTPDraft, root: torch.Tensor, y: torch.Tensor, cache: Cache, shape: TreeShape, temperature: float
) -> DraftTree:
    """The tree of `shape` from each row's root token [B] and the draft's y [B, H] of the last
    committed position. The expanded nodes' draft entries go to scratch slots after the committed
    ones (top_k per depth), each seeing the committed entries, its ancestors' entries and its own."""
    # No path of N nodes is deeper than N, and a node outranked by N others of its depth (or by N
    # siblings) is never verified, nor are its descendants: drafting wider or deeper than the node
    # budget would change nothing (but which of equal scores wins).
    k, deepest = min(shape.top_k, shape.nodes), min(shape.depth, shape.nodes)
    batch, device = y.shape[0], y.device
    pool = Pool()
    scores, tokens = draft_log_probs(draft, y, temperature).topk(k)  # depth 1: [B, k]
    ids = pool.add(tokens, scores, torch.full_like(tokens, -1), 1)
    parent_y = y[:, None].expand(-1, k, -1)
    sees = torch.zeros(batch, k, 0, dtype=torch.bool, device=device)  # over the expanded nodes' slots
    for depth in range(1, deepest):
        # This depth's k best nodes run as chained draft steps, each at its own slot, seeing its path.
        sees = torch.cat([sees, torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)], 2)
        positions = (cache.lengths - 1 + depth)[:, None].expand(-1, k)  # as `chain`'s step `depth`
        place = tree_placement(cache.lengths, cache.max_len, (depth - 1) * k, sees, positions)
        node_y = draft.chain_nodes(parent_y, tokens, cache, place)
        child_scores, child_tokens = (scores[..., None] + draft_log_probs(draft, node_y, temperature)).topk(k)
        child_ids = pool.add(
            child_tokens.flatten(1), child_scores.flatten(1), ids.repeat_interleave(k, 1), depth + 1
        )
        scores, best = child_scores.flatten(1).topk(k)  # the next depth's nodes to run
        tokens, ids = child_tokens.flatten(1).gather(1, best), child_ids.gather(1, best)
        parent = (best // k)[..., None]
        parent_y = node_y.gather(1, parent.expand(-1, -1, node_y.shape[-1]))
        sees = sees.gather(1, parent.expand(-1, -1, sees.shape[-1]))  # a child's path is its parent's
    return select(root, *pool.columns(), shape)


class Pool:
    """Every node drafting scored, in the order scored: tokens, cumulative draft log-probabilities,
    parents (pool indices, −1 for the root) and depths, [B, P] each once joined."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def add(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """Nodes [B, n] of one depth; returns their pool indices [B, n]."""
        first = sum(part[0].shape[1] for part in self.parts)
        self.parts.append((tokens, scores, parents, torch.full_like(tokens, depth)))
        return first + torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)

    def columns(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.cat(column, 1) for column in zip(*self.parts))


def select(
    root: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    shape: TreeShape,
) -> DraftTree:
    """The root and the `shape.nodes` best-scored pool nodes ([B, P] each; parents: pool indices,
    −1 for the root), kept in pool order so that parents come before their children."""
    batch, size = tokens.shape
    # Stable: on equal scores the earlier pool node, a parent before its children, ranks first.
    chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, : shape.nodes].sort(1).values
    position = torch.zeros(batch, size + 1, dtype=torch.long, device=tokens.device)  # pool index + 1 → tree
    position.scatter_(1, chosen + 1, torch.arange(1, shape.nodes + 1, device=tokens.device).expand(batch, -1))
    zero = root.new_zeros(batch, 1)
    tree_parents = torch.cat([zero, position.gather(1, parents.gather(1, chosen) + 1)], 1)
    return DraftTree(
        torch.cat([root[:, None], tokens.gather(1, chosen)], 1),
        tree_parents,
        torch.cat([zero, depths.gather(1, chosen)], 1),
        ancestry(tree_parents, shape.depth),
        torch.cat([scores.new_zeros(batch, 1), scores.gather(1, chosen)], 1),
    )


def ancestry(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """sees [B, S, S]: each node and its ancestors, from parents [B, S] (root: its own parent)."""
    batch, size = parents.shape
    sees = torch.eye(size, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    up = parents
    for _ in range(depth):
        sees.scatter_(2, up[..., None], True)
        up = parents.gather(1, up)
    return sees


# --- verification --------------------------------------------------------------------------------


def verify(target: TargetModel, tree: DraftTree, cache: Cache, capture: tuple[int, ...]) -> torch.Tensor:
    """The target's states [B, S, H] of every node, in one forward: node i at slot committed + i,
    rope position committed + depth, seeing the committed entries, its ancestors and itself."""
    positions = cache.lengths[:, None] + tree.depths
    place = tree_placement(cache.lengths, cache.max_len, 0, tree.sees, positions)
    return target.forward_cached(tree.tokens, cache, capture=capture, placement=place)


def accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    shape: TreeShape,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(path [B, depth + 1]: tree positions of the root and the accepted nodes, padded with the last;
    accepted draft tokens per row [B]; the target's token after them [B]).
    target_logits [B, S, V]: position i scores the token after node i."""
    if temperature == 0:
        return accept_greedy(tree, target_logits, shape.depth)
    return accept_sampled(tree, probabilities(target_logits, temperature), shape, generator)


def accept_greedy(
    tree: DraftTree, target_logits: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A node is accepted when its token is the target's argmax after its parent and its parent is
    accepted. Siblings hold distinct tokens, so the accepted nodes are one path; the target's argmax
    after its last node is the correction (or the bonus at a leaf)."""
    best = target_logits.argmax(-1)
    match = tree.tokens == best.gather(1, tree.parents)
    match[:, 0] = True
    accepted = match
    for _ in range(depth):
        accepted = match & accepted.gather(1, tree.parents)
    n = (tree.depths * accepted).amax(1)
    end = (accepted & (tree.depths == n[:, None])).long().argmax(1)
    return path_to(end, n, tree.parents, depth), n, best.gather(1, end[:, None])[:, 0]


def accept_sampled(
    tree: DraftTree, p: torch.Tensor, shape: TreeShape, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over siblings; p [B, S, V] the target's distribution after each node.

    From the root, with r = p at the current node: try its children in order (best draft score
    first); accept child x with probability r(x) / Σr, then continue from x with r = p at x; on
    rejection remove x from r (r(x) ← 0). At a node none of whose children is accepted, or a leaf,
    draw the token from r. This is SpecInfer's multi-step speculative sampling (Miao et al. 2024,
    arXiv:2305.09781, §4.2: accept with min(1, r(x)/q(x)), else r ← norm(max(0, r − q))) with each
    child's proposal q a point mass, because EAGLE-2 picks children deterministically (top-k), not
    by sampling: min(1, r(x)/1) and max(0, r − δ_x) are the lines above. EAGLE's own
    `evaluate_posterior` (github.com/SafeAILab/EAGLE, eagle/model/utils.py, EAGLE-2 version: `qx = 1.0`,
    `gtp[xi] = 0`, renormalized) does the same. Why it is exact: at a node, the token that leaves it
    is x_1 with probability r(x_1); otherwise, with probability 1 − r(x_1), it leaves under r with
    x_1 removed and renormalized, which is r off x_1. By induction over the siblings, it is drawn
    from r, and by induction over depths every token is drawn from the target's p."""
    batch, rows = p.shape[0], torch.arange(p.shape[0], device=p.device)
    children = children_of(tree, shape.top_k)
    end = torch.zeros(batch, dtype=torch.long, device=p.device)
    n = torch.zeros_like(end)
    r = p[:, 0].clone()
    going = torch.ones(batch, dtype=torch.bool, device=p.device)
    for _ in range(shape.depth):
        taken = torch.zeros_like(going)
        for rank in range(shape.top_k):
            child = children[rows, end, rank]
            trying = going & ~taken & (child >= 0)
            x = tree.tokens.gather(1, child.clamp(min=0)[:, None])[:, 0]
            u = torch.rand(batch, generator=generator, device=p.device)
            ok = trying & (u * r.sum(-1) < r.gather(1, x[:, None])[:, 0])
            r = torch.where((trying & ~ok)[:, None], rejected(r, x), r)
            taken, end = taken | ok, torch.where(ok, child, end)
        going &= taken
        n += taken
        r = torch.where(taken[:, None], p[rows, end], r)
    # All mass removed happens only through rounding (p ≈ the tried tokens): draw from p there.
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p[rows, end])
    return path_to(end, n, tree.parents, shape.depth), n, draw(r, generator)


def rejected(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual [B, V] after rejecting token x [B]: max(0, r − δ_x), unnormalized (r(x) ≤ Σr)."""
    return r.scatter(1, x[:, None], 0.0)


def children_of(tree: DraftTree, k: int) -> torch.Tensor:
    """[B, S, k]: the tree positions of each node's children in order, −1 past the last. Children
    of one node come from one top-k, in pool order: best draft score first."""
    batch, size = tree.parents.shape
    earlier = torch.ones(size, size, dtype=torch.bool, device=tree.parents.device).tril(-1)
    earlier[:, 0] = False  # the root is nobody's sibling
    rank = ((tree.parents[:, :, None] == tree.parents[:, None, :]) & earlier).sum(2)
    rank[:, 0] = k  # the root, which is no node's child, goes to a column dropped below
    children = torch.full((batch, size * (k + 1)), -1, dtype=torch.long, device=tree.parents.device)
    index = torch.arange(size, device=tree.parents.device).expand(batch, -1)
    children.scatter_(1, tree.parents * (k + 1) + rank, index)
    return children.view(batch, size, k + 1)[..., :k]


def path_to(end: torch.Tensor, n: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, depth + 1]: the tree positions from the root to `end` (n deep), then `end` repeated."""
    path = end[:, None].repeat(1, depth + 1)
    node = end
    for back in range(depth + 1):
        # Past the root the walk stays at the root (its own parent), rewriting path[:, 0] with 0.
        path.scatter_(1, (n - back).clamp(min=0)[:, None], node[:, None])
        node = parents.gather(1, node[:, None])[:, 0]
    return path


# --- the step --------------------------------------------------------------------------------------


class TreeStep:
    """One tree step for every row, eager (no CUDA graph: the tree's shapes change with its
    contents): the draft grows a tree, the target verifies all its nodes in one forward, the
    accepted path plus the target's own token are kept, and both caches commit them. The same
    interface as the chain's `speculative.SpecStep`."""

    def __init__(
        self, target, draft, target_cache, draft_cache, shape: TreeShape, temperature, generator, clock
    ):
        self.target, self.draft, self.shape = target, draft, shape
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.temperature, self.generator, self.clock = temperature, generator, clock

    def start(self, last: torch.Tensor, y: torch.Tensor, active: torch.Tensor) -> None:
        self.last, self.y, self.active = last.clone(), y.clone(), active.clone()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every active row; returns (kept [B, depth + 1], n_accepted [B])."""
        draft, tc, dc, shape = self.draft, self.target_cache, self.draft_cache, self.shape
        with self.clock.time("draft"):
            tree = grow(draft, self.last, self.y, dc, shape, self.temperature)
        with self.clock.time("target"):
            hidden = verify(self.target, tree, tc, draft.capture)
            logits = self.target.logits(hidden)
            path, n_accepted, last = accept(tree, logits, shape, self.temperature, self.generator)
            # The accepted nodes' entries to the slots after the root's, as if decoded one by one
            # (the padding copies land in scratch past the commit).
            depth = torch.arange(shape.depth + 1, device=path.device)
            tc.move(tc.lengths[:, None] + path, tc.lengths[:, None] + depth)
            commit = torch.where(self.active, n_accepted + 1, 0)
            tc.lengths += commit
        # A row's new tokens: the path's nodes, then the target's token; as in the chain they are
        # also the tokens following the committed positions, which the draft's refill reads.
        kept = torch.cat([tree.tokens.gather(1, path[:, 1:]), last[:, None]], 1)
        kept = kept.scatter(1, n_accepted[:, None], last[:, None])
        with self.clock.time("draft"):
            states = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))
            self.y = at_positions(draft.prefill(states, kept, dc), n_accepted)
            dc.lengths += commit
        self.last = last
        return kept, n_accepted
