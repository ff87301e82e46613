"""EAGLE-2 dynamic draft trees (`inference_ref.tree`): the tree mask against decoding each path
alone, the draft's tree against its own chained steps, greedy output identical to the target alone
(several kinds of target and head, batches whose rows accept differently), the sampled output's
distribution by a chi-square test (with a wrong sampler as control), and validation's report of
chains and trees at equal verify budgets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_speculative import (
    bigram_head,
    chi_square_pvalue,
    exact_joint,
    random_head,
    random_prompts,
    serve,
    small_target,
)

import mtp_train.export as ex
from inference_ref import tree as tree_module
from inference_ref.attention import tree_placement
from inference_ref.causal_lm import KVCache
from inference_ref.draft import MTPDraft, load_draft
from inference_ref.generate import at_positions, generate, prefill
from inference_ref.head_spec import HeadSpec
from inference_ref.models import TARGET_KINDS
from inference_ref.models.llama import load_llama
from inference_ref.speculative import Chain, draft_prefill, speculative_generate
from inference_ref.target import frozen_target_tensors, read_target_config
from inference_ref.tree import TreeShape, grow, verify
from mtp_train.config import ConfigError, checked
from mtp_train.heads import MTPHead, build
from mtp_train.target_files import target_identity
from mtp_train.validate import run_validation, summary
from tiny import assert_tau_consistent, frozen_of, randomized, recipe

REPO = Path(__file__).resolve().parent.parent
SHAPES = [TreeShape(2, 3, 6), TreeShape(4, 4, 12), TreeShape(5, 8, 40)]


def save_served(head: MTPHead, target, out: Path) -> MTPDraft:
    """Through the native format, for any kind of target and head."""
    identity = {"path": "", "config_hash": target.cfg.fingerprint()}
    return load_draft(ex.save_head(head, out, identity, {}, torch.float32), target)


# ---------------------------------------------------------------- the tree mask and the draft's tree


def test_tree_placement_by_hand():
    """Row 0: 2 committed entries and a root with children a, b and a's child c; row 1: none
    committed, a chain root → a → c. Each node sees the committed keys, its ancestors and itself."""
    parents = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 2]])
    sees = tree_module.ancestry(parents, depth=3)
    place = tree_placement(torch.tensor([2, 0]), 8, 0, sees, torch.zeros(2, 4, dtype=torch.long))
    assert place.slots.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3]]
    mask = place.mask[:, 0, :, :6].int().tolist()
    assert mask[0] == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert mask[1] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]


def committed_pair(target, draft, prompts: list[list[int]], room: int):
    """Both caches after the prompts (as the loop starts): the first token, the draft's y."""
    target_cache, hidden = prefill(target, prompts, max(map(len, prompts)) + room, draft.capture)
    first = target.logits(at_positions(hidden, target_cache.lengths - 1)).argmax(-1)
    draft_cache, y = draft_prefill(draft, hidden, prompts, first, target_cache.max_len)
    return target_cache, draft_cache, first, y


def path_of(tree, b: int, i: int) -> list[int]:
    """Tree positions from the root to node i of row b."""
    path = [i]
    while path[-1] != 0:
        path.append(int(tree.parents[b, path[-1]]))
    return path[::-1]


def test_verify_states_equal_each_path_decoded_alone(tmp_path):
    """The target's state of every node of one tree forward = the last state of prompt + the node's
    path run as an ordinary sequence; after the accepted path's entries move, the cache holds what
    decoding the path token by token would have left there."""
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (5, 12))
    shape = TreeShape(3, 3, 10)
    tc, dc, first, y = committed_pair(target, draft, prompts, 40)
    tree = grow(draft, first, y, dc, shape, 0.0)
    hidden = verify(target, tree, tc, ())
    for b, prompt in enumerate(prompts):
        for i in range(shape.nodes + 1):
            tokens = prompt + tree.tokens[b, path_of(tree, b, i)].tolist()
            alone = target.forward_cached(torch.tensor([tokens]), target.new_cache(1, len(tokens)))
            torch.testing.assert_close(hidden[b, i], alone[0, -1], rtol=1e-5, atol=1e-5)
    deepest = tree.depths.argmax(1)
    path, n = [path_of(tree, b, int(deepest[b])) for b in range(2)], tree.depths.amax(1)
    src = torch.tensor(path) + tc.lengths[:, None]
    tc.move(src, tc.lengths[:, None] + torch.arange(len(path[0])))
    for b, prompt in enumerate(prompts):
        tokens = prompt + tree.tokens[b, path[b]].tolist()
        alone = target.new_cache(1, len(tokens))
        target.forward_cached(torch.tensor([tokens]), alone)
        end = len(prompt) + int(n[b]) + 1
        torch.testing.assert_close(tc.k[:, b, :end], alone.k[:, 0, :end], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tc.v[:, b, :end], alone.v[:, 0, :end], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_tree_scores_equal_its_chained_steps(temperature, tmp_path):
    """Every node's score is the draft's log-probability of its path computed by `chain` step by
    step (so each tree node's draft entry saw its own path and nothing else); the nodes form a tree
    (parents first, one deeper than their parent, distinct siblings); the best-scored are kept."""
    target = small_target()
    draft = serve(random_head(target, "eagle1", seed=2, scale=0.3), target, tmp_path)
    prompts = random_prompts(64, (4, 9, 1))
    shape = TreeShape(4, 3, 20)
    _, dc, first, y = committed_pair(target, draft, prompts, 40)
    tree = grow(draft, first, y, dc, shape, temperature)
    assert (tree.parents[:, 1:] < torch.arange(1, shape.nodes + 1)).all()
    assert torch.equal(tree.depths[:, 1:], tree.depths.gather(1, tree.parents)[:, 1:] + 1)
    for b in range(len(prompts)):
        siblings = {}
        row_cache = KVCache(dc.k[:, b : b + 1], dc.v[:, b : b + 1], dc.lengths[b : b + 1])
        for i in range(1, shape.nodes + 1):
            siblings.setdefault(int(tree.parents[b, i]), []).append(int(tree.tokens[b, i]))
            tokens = tree.tokens[b : b + 1, path_of(tree, b, i)[1:]]  # [1, depth]
            step_y, score = y[b : b + 1], 0.0
            for step in range(tokens.shape[1]):
                if step > 0:  # the draft's own chain along the node's path, as a chain loop drafts it
                    step_y = draft.chain(step_y, tokens[:, step - 1], row_cache, step)
                score += float(tree_module.draft_log_probs(draft, step_y, temperature)[0, tokens[0, step]])
            assert math.isclose(float(tree.scores[b, i]), score, rel_tol=1e-4, abs_tol=1e-4), (b, i)
        assert all(len(set(tokens)) == len(tokens) for tokens in siblings.values())


def test_a_small_budget_drafts_the_best_nodes_of_the_full_tree(tmp_path):
    """Drafting no wider or deeper than the node budget (what `grow` does for N < top_k or depth)
    keeps exactly the N best nodes the full expansion would have kept."""
    target = small_target()
    draft = serve(random_head(target, "eagle1", seed=2, scale=0.3), target, tmp_path)
    prompts = random_prompts(64, (4, 9, 1))
    _, dc, first, y = committed_pair(target, draft, prompts, 400)

    def paths(tree, b: int, nodes: list[int]) -> set[tuple[int, ...]]:
        return {tuple(tree.tokens[b, path_of(tree, b, i)].tolist()) for i in nodes}

    for nodes in (1, 3, 5):
        small = grow(draft, first, y, dc, TreeShape(5, 8, nodes), 0.0)
        full = grow(draft, first, y, dc, TreeShape(5, 8, 200), 0.0)
        for b in range(len(prompts)):
            ranked = full.scores[b, 1:].sort(descending=True, stable=True).indices  # ties: parents first
            best = (ranked[:nodes] + 1).tolist()
            assert paths(small, b, range(1, nodes + 1)) == paths(full, b, best)


# ---------------------------------------------------------------- greedy: identical to the target alone


@pytest.mark.parametrize("variant", ["rmsnorm-restored", "eagle1"])
def test_greedy_tree_equals_target_alone_with_a_good_draft(variant, tmp_path):
    """Rows accept different numbers of tokens at each step and stop at different steps."""
    target = small_target()
    draft = serve(bigram_head(target, variant), target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1, 6, 30))
    eos = [5]
    expected = generate(target, prompts, 40, eos)
    chain = speculative_generate(target, draft, prompts, 40, eos, Chain(4)).stats.mean_accepted_len
    for shape in SHAPES:
        out = speculative_generate(target, draft, prompts, 40, eos, shape)
        assert out.tokens == expected, shape
        assert out.stats.k == shape.depth and out.stats.mean_accepted_len > 1.5
    assert out.stats.mean_accepted_len > chain  # 41 verified tokens against the chain's 5


def test_a_one_wide_tree_is_the_chain(tmp_path):
    """top_k = 1 and as many nodes as the depth: the tree is the greedy chain, step for step."""
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1))
    for k in (1, 3):
        chain = speculative_generate(target, draft, prompts, 30, [5], Chain(k))
        tree = speculative_generate(target, draft, prompts, 30, [5], TreeShape(k, 1, k))
        assert tree.tokens == chain.tokens
        assert (tree.stats.tried, tree.stats.accepted, tree.stats.steps) == (
            chain.stats.tried,
            chain.stats.accepted,
            chain.stats.steps,
        )


def test_greedy_tree_equals_target_alone_with_a_random_head(tmp_path, tiny_target):
    """SmolLM2's vocabulary (49k) on a tiny random target: acceptance is rare, corrections frequent."""
    tiny = load_llama(tiny_target)
    draft = serve(random_head(tiny, "rmsnorm-restored", scale=0.02), tiny, tmp_path)
    prompts = random_prompts(tiny.cfg.vocab_size, (5, 12, 2, 20))
    eos = tiny.cfg.eos_token_ids
    expected = generate(tiny, prompts, 24, eos)
    for shape in SHAPES[:2]:
        assert speculative_generate(tiny, draft, prompts, 24, eos, shape).tokens == expected


def test_greedy_tree_equals_target_alone_on_smollm2(smollm2, tmp_path):
    """Real weights: the tree mask and its rope positions match token-by-token decoding in fp32."""
    from transformers import AutoTokenizer

    target = load_llama(smollm2)
    draft = serve(random_head(target, "rmsnorm-restored", scale=0.02), target, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a color.")]
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats
    ]
    eos = target.cfg.eos_token_ids
    expected = generate(target, prompts, 16, eos)
    assert speculative_generate(target, draft, prompts, 16, eos, TreeShape(3, 4, 10)).tokens == expected


def random_kind_pair(kind: str, tmp_path: Path, **shape):
    """A tiny random target of `kind` (vocabulary 64) and a random restored head on it."""
    spec = TARGET_KINDS[kind]
    cfg = spec.config(vocab_size=64, **{**spec.tiny, **shape})
    target = spec.random(cfg, seed=0)
    head = randomized(MTPHead(HeadSpec("rmsnorm-restored", cfg), frozen_of(target)), seed=1, scale=0.05)
    return target, save_served(head, target, tmp_path / "head")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "deepseek_v2"])
def test_greedy_tree_on_other_target_kinds(kind, tmp_path):
    """Every kind's cached forward takes the tree's placement (DeepSeek-V2: the latent cache, whose
    entries move as K/V do)."""
    target, draft = random_kind_pair(kind, tmp_path)
    prompts = random_prompts(64, (3, 11, 6))
    expected = generate(target, prompts, 20, [])
    assert speculative_generate(target, draft, prompts, 20, [], TreeShape(3, 3, 8)).tokens == expected


def test_greedy_tree_with_a_bigram_deepseek_draft(tmp_path):
    """A good draft on DeepSeek-V2 (MLA in both the target and the head): long accepted paths."""
    from test_deepseek_head import bigram_pair

    target, draft = bigram_pair(tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1))
    expected = generate(target, prompts, 32, [5])
    out = speculative_generate(target, draft, prompts, 32, [5], TreeShape(4, 4, 16))
    assert out.tokens == expected and out.stats.mean_accepted_len > 2


def test_greedy_tree_with_an_eagle3_draft(tmp_path):
    """EAGLE-3: fc over captured aux states (the tree forward captures them too), and a draft
    vocabulary: nodes are drafted from it only."""
    target = small_target()
    vocab = torch.arange(0, 64, 2)  # every other token: half the target's vocabulary
    spec = HeadSpec("eagle3", target.cfg, aux_layers=(0, 1), draft_vocab_size=len(vocab))
    head = randomized(build(spec, frozen_of(target), vocab), seed=4, scale=0.2)
    draft = save_served(head, target, tmp_path / "head")
    prompts = random_prompts(64, (3, 9, 17, 1))
    expected = generate(target, prompts, 24, [])
    shape = TreeShape(3, 4, 12)
    assert speculative_generate(target, draft, prompts, 24, [], shape).tokens == expected
    tc, dc, first, y = committed_pair(target, draft, prompts, 40)
    nodes = grow(draft, first, y, dc, shape, 0.0).tokens[:, 1:]
    assert torch.isin(nodes, vocab).all()


def test_padding_does_not_leak_into_the_tree(tmp_path):
    """A row's tree output and acceptance do not depend on which other rows share its batch."""
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (2, 19, 6))
    shape = TreeShape(4, 3, 10)
    together = speculative_generate(target, draft, prompts, 25, [], shape)
    alone = [speculative_generate(target, draft, [p], 25, [], shape) for p in prompts]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert together.stats.accepted == [sum(a.stats.accepted[j] for a in alone) for j in range(4)]


# ---------------------------------------------------------------- sampling: the target's distribution


def sampled_tree_run(shape: TreeShape, temperature: float, draft: str, tmp_path: Path, runs: int = 4000):
    """`runs` independent 3-token samples (copies of one prompt in one batch), drafted by trees of a
    `poor` draft (random: mostly rejected, residual draws) or a `fair` one (accepted paths,
    rejected siblings, bonus tokens)."""
    target = small_target()
    head = (
        random_head(target, "rmsnorm-restored", seed=3, scale=0.3)
        if draft == "poor"
        else bigram_head(target, "eagle1")
    )
    prompt = [3, 14, 15, 9]
    g = torch.Generator().manual_seed(0)
    draft_ = serve(head, target, tmp_path)
    out = speculative_generate(target, draft_, [prompt] * runs, 3, [], shape, temperature, g)
    return out, exact_joint(target, prompt, temperature)


@pytest.mark.parametrize(
    "shape, temperature, draft",
    [
        (TreeShape(1, 3, 3), 1.0, "poor"),
        (TreeShape(3, 3, 8), 1.0, "poor"),
        (TreeShape(2, 2, 4), 1.0, "fair"),
        (TreeShape(3, 3, 8), 1.0, "fair"),
        (TreeShape(3, 4, 12), 0.6, "fair"),
    ],
)
def test_tree_sampling_preserves_the_target_distribution(shape, temperature, draft, tmp_path):
    out, probs = sampled_tree_run(shape, temperature, draft, tmp_path)
    assert chi_square_pvalue(out.tokens, probs) > 1e-3
    if draft == "fair":  # paths of several nodes were accepted: the test exercised depth
        assert out.stats.accepted[1] > 100


@pytest.mark.parametrize("draft", ["poor", "fair"])
def test_the_distribution_test_detects_a_wrong_tree_sampler(draft, tmp_path, monkeypatch):
    """Control: keeping a rejected sibling in the residual (resampling from p after a rejection,
    the classic bug) over-weights the draft's candidates, and the test above catches it."""
    monkeypatch.setattr(tree_module, "rejected", lambda r, x: r)
    out, probs = sampled_tree_run(TreeShape(2, 2, 4), 1.0, draft, tmp_path)
    assert chi_square_pvalue(out.tokens, probs) < 1e-3


# ---------------------------------------------------------------- validation: chains and trees


def test_tree_budgets_are_range_checked():
    cfg = recipe(["model=tiny_random", "model.target=x", "validate.tree_budgets=[16,300]"])
    with pytest.raises(
        ConfigError, match=r"validate.tree_budgets=\[16, 300\]: must be node budgets in 1 … 264"
    ):
        checked(cfg)


def test_validation_reports_chains_and_trees_at_equal_verify_budgets(tiny_target, tmp_path):
    """A random head on the tiny target: every chain and tree entry says how many tokens its
    verify processes, greedy trees are identical to the target alone, τ agrees with the per-depth
    rates, and the summary and the plot set chains beside trees."""
    spec = HeadSpec("rmsnorm-restored", read_target_config(tiny_target))
    head = randomized(MTPHead(spec, frozen_target_tensors(tiny_target)), seed=0)
    ex.save_head(head, tmp_path / "head", target_identity(tiny_target), {}, torch.float32)
    cfg = recipe(
        [
            "model=tiny_random",
            f"model.target={tiny_target}",
            "model.dtype=float32",
            f"run_dir={tmp_path / 'run'}",
            f"validate.head={tmp_path / 'head'}",
            f"validate.eval_files=[{REPO / 'data/mt_bench.jsonl'}]",
            "validate.num_prompts=2",
            "validate.max_new_tokens=10",
            "validate.chain_lengths=[1,3]",
            "validate.tree_budgets=[3,8]",
            "validate.tree_depth=3",
            "validate.tree_top_k=3",
            "validate.teacher_forced_samples=1",
        ]
    )
    report = run_validation(cfg)
    for mode in ("greedy", "T=1"):
        runs = report["speculative"][mode]
        assert list(runs) == ["k=1", "k=3", "tree n=3", "tree n=8"]
        assert [r["verify_tokens"] for r in runs.values()] == [2, 4, 4, 9]
        assert runs["tree n=8"] | {"draft": "tree", "depth": 3, "top_k": 3, "nodes": 8} == runs["tree n=8"]
        for run in runs.values():
            assert_tau_consistent(run, run.get("k", run.get("depth")))
            if mode == "greedy":
                assert run["identical_to_target_greedy"]
    text = summary(report)
    assert "a tree of 8 draft nodes (depth ≤ 3, top-3 expansion), 9 tokens per verify" in text
    assert (
        "greedy, τ by tokens per verify forward (chains and trees at equal verify budgets): 2: chain" in text
    )
    written = json.loads(Path(cfg.validate.report).read_text())
    assert written["speculative"]["greedy"]["tree n=3"]["verify_tokens"] == 4
    assert Path(cfg.validate.report).with_suffix(".png").stat().st_size > 0
