"""A draft vocabulary on the rmsnorm-restored and eagle1 heads: the lm_head keeps the store's most
frequent tokens, training scores only them, serving maps them back to target ids (greedy output
still the target's), the native export carries `d2t`, and the engines' whole-vocabulary layouts
refuse it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inference_ref.draft import load_draft
from inference_ref.head_spec import HeadSpec, draft_ids
from inference_ref.target import load_target
from mtp_train.export import export, load_head
from mtp_train.precompute import run_precompute
from mtp_train.run import Target
from mtp_train.serving.layouts import LayoutUnsupported
from mtp_train.store import Store
from mtp_train.train import train
from mtp_train.validate import run_validation, summary
from tiny import assert_serves_as_trained, assert_tau_consistent, recipe, supervised_counts

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "tests" / "data" / "gsm8k_64.jsonl"
MT_BENCH = REPO / "data" / "mt_bench.jsonl"
VOCAB = 1024


def overrides(target: Path, run: Path, variant: str, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        f"model.variant={variant}",
        f"model.draft_vocab_size={VOCAB}",
        f"run_dir={run}",
        f"data.train_files=[{GSM8K}]",
        "data.max_samples=24",
        "train.steps=6",
        "train.unroll_steps=2",
        "train.warmup_steps=2",
        "train.tokens_per_micro_batch=512",
        "train.save_every=0",
        f"validate.eval_files=[{MT_BENCH}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=12",
        "validate.chain_lengths=[2]",
        "validate.teacher_forced_samples=2",
        # the rest of what validation reports, on the same run: SSD, Saguaro sampling, a tree
        "validate.ssd_fan_outs=[1,4]",
        "validate.saguaro_factors=[0.5]",
        "validate.tree_budgets=[4]",
        "validate.tree_depth=2",
        "validate.tree_top_k=2",
        f"validate.verify_costs=[{REPO / 'benchmarks/results/verify_cost_llama3_8b.json'}]",
        "export.formats=[native]",
        "export.dtype=float32",
        *extra,
    ]


@pytest.fixture(scope="module", params=["rmsnorm-restored", "eagle1"])
def pipeline(request, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp(f"vocab_{request.param}")
    cfg = recipe(overrides(tiny_target, run, request.param))
    store = run_precompute(cfg)
    train(cfg)
    return {"cfg": cfg, "store": store, "report": run_validation(cfg), "exported": export(cfg)}


def test_the_head_scores_the_stores_most_frequent_tokens(pipeline, tiny_target):
    cfg = pipeline["cfg"]
    head = load_head(Path(cfg.train.out_dir) / "head", Target.resolve(str(tiny_target)))
    # counted here from the store's samples, not with the store's own counter that training calls
    vocab_size = head.spec.target.vocab_size
    counts = supervised_counts(Store(pipeline["store"]), vocab_size)
    ranked = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))  # ties: the lower id
    ids = torch.tensor(sorted(ranked[:VOCAB]))
    assert torch.equal(head.draft_ids, ids)
    full = load_target(tiny_target).lm_head.weight
    assert head.lm_head_weight.shape == (VOCAB, full.shape[1])
    torch.testing.assert_close(head.lm_head_weight, full[ids])


def test_it_serves_through_the_loop_with_target_ids(pipeline):
    # the draft's ids mapped back give the target's output; training (restricted softmax over the
    # draft vocabulary) and serving (the same restriction) agree
    assert_serves_as_trained(pipeline["report"], k=2)
    assert_tau_consistent(pipeline["report"]["speculative"]["T=1"]["k=2"], k=2)


def test_the_native_export_carries_d2t_and_loads_back(pipeline, tiny_target):
    native = pipeline["exported"]["native"]
    config_ = json.loads((native / "config.json").read_text())
    assert config_["draft_vocab_size"] == VOCAB and "aux_layers" not in config_
    assert HeadSpec.from_config(config_).draft_vocab_size == VOCAB
    tensors = load_file(str(native / "head.safetensors"))
    assert tensors["d2t"].shape == (VOCAB,) and "lm_head.weight" not in tensors
    draft = load_draft(native, load_target(tiny_target))
    ids = draft_ids(tensors["d2t"])
    assert torch.equal(draft.draft_ids, ids)
    logits = draft.logits(torch.randn(3, draft.spec.target.hidden_size))
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isfinite(logits[:, ids]).all() and torch.isneginf(logits[:, outside]).all()


@pytest.mark.parametrize("layout", ["eagle1", "deepseek_mtp"])
def test_whole_vocabulary_engine_layouts_refuse_it(pipeline, layout, tmp_path):
    cfg = pipeline["cfg"]
    cfg.export.formats, cfg.export.out_dir = [layout], str(tmp_path / "export")
    with pytest.raises(LayoutUnsupported, match="draft vocabulary of 1024 tokens"):
        export(cfg)
    assert not (tmp_path / "export").exists()


def test_the_vllm_layout_is_exported_with_its_draft_lm_head(pipeline, tmp_path):
    """`export.formats=[vllm]` (the layout the plugin's classes load) writes the draft vocabulary's
    lm_head rows and d2t: the layout holds shared tensors itself."""
    cfg = pipeline["cfg"]
    cfg.export.formats, cfg.export.out_dir = ["vllm"], str(tmp_path / "export")
    written = export(cfg)["vllm"]
    tensors = load_file(str(written / "model.safetensors"))
    assert tensors["lm_head.weight"].shape[0] == VOCAB and tensors["d2t"].shape == (VOCAB,)
    assert json.loads((written / "config.json").read_text())["draft_vocab_size"] == VOCAB


def test_the_report_carries_ssd_hits_saguaro_runs_and_trees(pipeline):
    greedy, sampled = pipeline["report"]["speculative"]["greedy"], pipeline["report"]["speculative"]["T=1"]
    for run in (greedy["k=2"], sampled["k=2"]):
        rate = run["ssd_hit_rate"]
        assert list(rate) == ["1", "4"] and 0 <= rate["1"] <= rate["4"] <= 1
        assert run["counts_ssd_hits"] == [round(r * run["counts"]["steps"]) for r in rate.values()]
    saguaro = sampled["k=2 saguaro c=0.5"]
    assert saguaro["saguaro"] == {"factor": 0.5, "fan_out": 4} and set(saguaro["ssd_hit_rate"]) == {"1", "4"}
    assert_tau_consistent(saguaro, k=2)
    assert "k=2 saguaro c=0.5" not in greedy  # Saguaro reshapes a sampled draft only
    assert greedy["tree n=4"]["draft"] == "tree" and "ssd_hit_rate" not in greedy["tree n=4"]
    # per MT-bench category (the two prompts are both "writing"): the same counts as the whole
    run = greedy["k=2"]
    assert list(run["by_category"]) == ["writing"]
    writing = run["by_category"]["writing"]
    assert writing["steps"] == run["counts"]["steps"]
    assert writing["mean_accepted_len"] == run["mean_accepted_len"]
    assert writing["accept_first"] == run["accept_rate"][0]
    text = summary(pipeline["report"])
    assert "SSD: verifies whose outcome" in text and "Saguaro sampling" in text
    # projected on the 8B shape's measured costs: every greedy chain and the tree, per batch size
    projected = pipeline["report"]["projected"]["llama3_8b"]
    assert set(projected["speedup"]["1"]) == {"k=1", "k=2", "tree n=4"}
    assert "projected on the llama3_8b shape" in text
