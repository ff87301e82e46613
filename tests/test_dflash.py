"""The DFlash block drafter (#39): the serving draft against the training head, the loop with it
against the target alone (greedy identical, sampling keeping the target's distribution), its
acceptance against a teacher-forced count made with the training module, and what it refuses.

The heads here are `DFlashHead`s on a tiny mostly-bigram Llama (`test_speculative.small_target`),
exported in the native format and loaded back through `inference_ref.draft.load_draft`. The
pipeline (store, training, validation, export) and vLLM serving it are tested further down and in
tests/test_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_speculative import (
    chi_square_pvalue,
    count_along_greedy_path,
    exact_joint,
    export_native,
    random_prompts,
    small_target,
    training_outputs,
)

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.dflash import DFlashDraft
from inference_ref.draft import load_draft
from inference_ref.generate import generate
from inference_ref.head_spec import HeadSpec, dflash_aux_layers
from inference_ref.speculative import SSD, Chain, speculative_generate
from inference_ref.tree import TreeShape
from mtp_train.batching import collate
from mtp_train.heads.dflash import DFlashHead
from mtp_train.losses import DraftObjective, LossWeights
from tiny import frozen_of, randomized, recipe, rel_err

BLOCK, LAYERS = 4, 2


def dflash_head(target, seed: int = 0, scale: float = 0.1, block: int = BLOCK) -> DFlashHead:
    """Every trainable tensor random (norms around 1); mask token: the last id."""
    spec = HeadSpec(
        "dflash",
        target.cfg,
        aux_layers=(1,),
        layers=LAYERS,
        block_size=block,
        mask_token_id=target.cfg.vocab_size - 1,
    )
    torch.manual_seed(seed)
    return randomized(DFlashHead(spec, frozen_of(target)), scale=scale)


def serve(head: DFlashHead, target, tmp_path: Path) -> DFlashDraft:
    draft = load_draft(export_native(head, tmp_path / "head", **head.spec.to_config()), target)
    assert isinstance(draft, DFlashDraft)
    return draft


def widened(target, seq: torch.Tensor) -> torch.Tensor:
    """The target's states of `seq` [n] with layer 1's entering state: [n, 2H]."""
    hidden, _ = target.forward_packed(seq, cu_seqlens_of([len(seq)]), capture=(1,))
    return hidden


def test_the_serving_block_is_the_trained_block(tmp_path):
    """Block rows 1 … B−1 of the training module at every base i = the serving draft's one-forward
    block [t_{i+1}, mask × (B−1)] over the context entries 0 … i (one batch row per base)."""
    target = small_target()
    n = 14
    seq = torch.randint(0, 64, (n + 1,), generator=torch.Generator().manual_seed(2))
    hidden = widened(target, seq[:n])
    head = dflash_head(target)
    _, ref_logits = training_outputs(head, hidden.clone(), seq[1 : n + 1][None], [n], steps=BLOCK - 1)

    draft = serve(head, target, tmp_path)
    bases = torch.tensor([0, 4, 9, n - 1])
    cache = draft.new_cache(len(bases), n + BLOCK)
    draft.prefill(hidden[None].expand(len(bases), n, -1), seq[None, 1 : n + 1].expand(len(bases), n), cache)
    cache.lengths = bases + 1  # the rest is scratch: the block is written over it
    _, _, logits = draft.propose(None, seq[bases + 1], cache, BLOCK - 1, 0.0, None)
    assert rel_err(logits, ref_logits[:, bases].transpose(0, 1)) <= 1e-4
    # The teacher-forced path (validation's parity check): every base's first mask at once.
    tf = draft.teacher_forced_logits(hidden[None], seq[None, 1 : n + 1])
    assert rel_err(tf, ref_logits[0]) <= 1e-4


def test_the_block_sees_no_future_context_and_the_whole_block(tmp_path):
    """Changing the target's state after the anchor changes nothing; changing the last mask's
    embedding (the block's end) changes the first mask's output: no causal mask inside the block."""
    target = small_target()
    head = dflash_head(target, seed=4)
    seq = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3))
    hidden = widened(target, seq)
    _, logits = training_outputs(head, hidden.clone(), seq[None], [10], steps=BLOCK - 1)
    later = hidden.clone()
    later[6:] += 1.0
    _, moved = training_outputs(head, later, seq[None], [10], steps=BLOCK - 1)
    assert torch.equal(logits[:, :6], moved[:, :6]) and not torch.allclose(logits[:, 6:], moved[:, 6:])
    shorter = dflash_head(target, seed=4, block=BLOCK - 1)  # the same tensors, one mask fewer
    _, fewer = training_outputs(shorter, hidden.clone(), seq[None], [10], steps=1)
    assert not torch.allclose(fewer[0], logits[0])


def test_default_target_layers_follow_the_references():
    """z-lab / SpecForge `build_target_layer_ids`, +1 for entering-state numbering: Qwen3-8B's 36
    layers and 5 draft layers → [1, 9, 17, 25, 33] (their ids) → [2, 10, 18, 26, 34] here."""
    assert dflash_aux_layers(36, 5) == (2, 10, 18, 26, 34)
    assert dflash_aux_layers(30, 1) == (16,)


def trained_head(target, sequences: list[torch.Tensor], steps: int = 150) -> DFlashHead:
    """A DFlash head fitted a little to the target's own greedy text (Adam, fp32, DFlash's loss)."""
    head = dflash_head(target, seed=5, scale=0.02)
    samples = [(s, torch.ones(len(s), dtype=torch.uint8), widened(target, s)) for s in sequences]
    batch = collate(samples, BLOCK - 1)
    objective = DraftObjective(head, LossWeights(1.0, 0.0), 2**20, decay=0.78)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = objective(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    target = small_target()
    prompts = random_prompts(64, (5, 9, 4, 7, 6, 8), seed=7)
    texts = [torch.tensor(p + more) for p, more in zip(prompts, generate(target, prompts, 40, []))]
    return target, trained_head(target, texts), random_prompts(64, (4, 11, 7), seed=8)


def test_greedy_with_a_block_drafter_equals_target_alone(fitted, tmp_path):
    target, head, prompts = fitted
    draft = serve(head, target, tmp_path)
    alone = generate(target, prompts, 30, [])
    for k in (1, BLOCK - 1):
        out = speculative_generate(target, draft, prompts, 30, [], Chain(k))
        assert out.tokens == alone
    assert sum(out.stats.accepted) > 15  # the fitted head is accepted often enough to mean something


def test_loop_acceptance_equals_teacher_forced_blocks(fitted, tmp_path):
    """The loop's greedy counts = a count made with the training module on the target's greedy
    continuation: at base i the block anchored at t_{i+1} proposes row j for t_{i+1+j}."""
    target, head, prompts = fitted
    k, max_new = BLOCK - 1, 30
    stats = speculative_generate(target, serve(head, target, tmp_path), prompts, max_new, [], Chain(k)).stats
    tried, accepted = [0] * k, [0] * k
    for prompt, more in zip(prompts, generate(target, prompts, max_new + k + 1, [])):
        seq = torch.tensor(prompt + more)
        n = len(seq) - k - 1
        _, logits = training_outputs(head, widened(target, seq[:n]), seq[1 : n + 1][None], [n], steps=k)
        count_along_greedy_path(logits, seq, len(prompt), max_new, tried, accepted)
    assert (stats.tried, stats.accepted) == (tried, accepted)


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_with_a_block_drafter_keeps_the_target_distribution(k, fitted, tmp_path):
    target, head, _ = fitted
    prompt = [3, 14, 15, 9]
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target, serve(head, target, tmp_path), [prompt] * 4000, 3, [], Chain(k), 1.0, g
    )
    assert sum(out.stats.accepted) > 300  # drafts accepted and rejected both
    assert chi_square_pvalue(out.tokens, exact_joint(target, prompt, 1.0)) > 1e-3


def test_a_block_drafter_refuses_trees_and_ssd(tmp_path):
    target = small_target()
    draft = serve(dflash_head(target), target, tmp_path)
    for shape, ssd in ((TreeShape(2, 2, 4), None), (Chain(2), SSD())):
        with pytest.raises(ValueError, match="drafts a block per verify"):
            speculative_generate(target, draft, [[1, 2, 3]], 4, [], shape, ssd=ssd)


# ---------------------------------------------------------------- the pipeline, on a tiny random target

REPO = Path(__file__).resolve().parent.parent
AUX = [1, 3]  # on a 4-layer target: the references' spread needs more layers than 2 draft layers here


def pipeline_overrides(target: Path, run: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        "model.variant=dflash",
        f"model.aux_layers={AUX}",
        f"model.draft_layers={LAYERS}",
        f"model.block_size={BLOCK}",
        "model.draft_vocab_size=2048",
        "precompute.aux=true",
        f"run_dir={run}",
        f"data.train_files=[{REPO / 'tests' / 'data' / 'gsm8k_64.jsonl'}]",
        "data.max_samples=24",
        "train.steps=8",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.tokens_per_micro_batch=512",
        "train.save_every=0",
        "logging.log_every=1",
        f"validate.eval_files=[{REPO / 'data' / 'mt_bench.jsonl'}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=12",
        f"validate.chain_lengths=[{BLOCK - 1}]",
        "validate.teacher_forced_samples=2",
        "export.formats=[native,vllm]",
        "export.dtype=float32",
        *extra,
    ]


@pytest.fixture(scope="module")
def pipeline(smollm2, tmp_path_factory):
    """A 4-layer random Llama: precompute with DFlash's layers, train, validate, export."""
    from mtp_train.export import export
    from mtp_train.precompute import run_precompute
    from mtp_train.target_files import write_random_target
    from mtp_train.train import train
    from mtp_train.validate import run_validation

    target = write_random_target(
        tmp_path_factory.mktemp("target"), smollm2, seed=1, num_hidden_layers=4, tie_word_embeddings=False
    )
    run = tmp_path_factory.mktemp("dflash_run")
    cfg = recipe(pipeline_overrides(target, run))
    store = run_precompute(cfg)
    train(cfg)
    return {
        "cfg": cfg,
        "store": store,
        "report": run_validation(cfg),
        "exported": export(cfg),
        "target": target,
    }


def test_dflash_trains_validates_and_serves_as_trained(pipeline):
    from tiny import assert_serves_as_trained

    report = pipeline["report"]
    assert_serves_as_trained(report, k=BLOCK - 1)
    assert report["speculative"]["greedy"][f"k={BLOCK - 1}"]["counts"]["tried"][0] > 0
    native = json.loads((pipeline["exported"]["native"] / "config.json").read_text())
    assert (native["variant"], native["layers"], native["block_size"], native["aux_layers"]) == (
        "dflash",
        LAYERS,
        BLOCK,
        AUX,
    )
    assert native["mask_token_id"] == 2  # SmolLM2's tokenizer: no mask token, no unused row, pad = EOS


def test_the_vllm_layout_is_dflash_draft_model(pipeline):
    """The names, shapes and config vLLM's DFlashDraftModel reads (the loader is cited in layouts.py;
    tests/test_vllm.py has vLLM serve it with our counts)."""
    from safetensors.torch import load_file

    out = pipeline["exported"]["vllm"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [k - 1 for k in AUX]}
    assert (cfg["num_hidden_layers"], cfg["block_size"], cfg["draft_vocab_size"]) == (LAYERS, BLOCK, 2048)
    assert "causal" not in cfg["dflash_config"] and "layer_types" not in cfg  # non-causal, as trained
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"} <= names
    assert {f"layers.{i}.self_attn.k_norm.weight" for i in range(LAYERS)} <= names
    assert not any(n.startswith("embed_tokens") or n.startswith("layer.") for n in names)


def test_dflash_refusals_name_the_fix(pipeline, tmp_path):
    from mtp_train.export import export
    from mtp_train.serving.layouts import LayoutUnsupported
    from mtp_train.train import train

    target = pipeline["target"]
    store = f"precompute.store_dir={pipeline['store']}"
    with pytest.raises(ValueError, match=r"precompute.aux=true model.aux_layers=\[2\]"):
        train(recipe(pipeline_overrides(target, tmp_path, store, "model.aux_layers=[2]")))
    with pytest.raises(LayoutUnsupported, match="drafts a block"):
        export(recipe(pipeline_overrides(target, pipeline["cfg"].run_dir, "export.formats=[eagle3]")))
    with pytest.raises(ValueError, match="a block of ≥ 2 tokens"):
        HeadSpec("dflash", small_target().cfg, aux_layers=(1,), layers=1, block_size=1)
    with pytest.raises(ValueError, match="blocks are dflash's"):
        HeadSpec("eagle3", small_target().cfg, aux_layers=(1,), block_size=4)
