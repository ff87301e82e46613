"""Qwen3 and Qwen3-MoE targets: parity with transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on
tiny random configs (fp32), greedy decoding, and heads trained, validated and exported on them — each
kind added as one module (`inference_ref/models/qwen3.py`, `qwen3_moe.py`), one registry entry and
one training-layer table line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.generate import generate
from inference_ref.models import TARGET_KINDS
from inference_ref.models.qwen3 import Qwen3Config, random_qwen3
from inference_ref.models.qwen3_moe import Qwen3MoeConfig
from inference_ref.target import load_target, read_target_config
from mtp_train.export import export
from mtp_train.precompute import run_precompute
from mtp_train.target_files import write_random_target
from mtp_train.train import train
from mtp_train.validate import run_validation
from tiny import assert_serves_as_trained, recipe, rel_err

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "tied": Qwen3Config(vocab_size=256, **TARGET_KINDS["qwen3"].tiny),
    "untied-mha": Qwen3Config(
        vocab_size=256,
        **{**TARGET_KINDS["qwen3"].tiny, "tie_word_embeddings": False, "num_key_value_heads": 4},
    ),
    # Qwen3-MoE: a dense layer 0 (mlp_only_layers) then 8 experts, top 2, renormalized or not.
    "moe": Qwen3MoeConfig(vocab_size=256, **TARGET_KINDS["qwen3_moe"].tiny),
    "moe-unnormalized": Qwen3MoeConfig(
        vocab_size=256, **{**TARGET_KINDS["qwen3_moe"].tiny, "norm_topk_prob": False, "mlp_only_layers": ()}
    ),
}
HF_CLASSES = {
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig),
}


@pytest.fixture(params=list(CONFIGS))
def twins(request, tmp_path):
    """transformers' Qwen3ForCausalLM with random weights, saved and loaded back by our loader."""
    cfg = CONFIGS[request.param]
    model_class, config_class = HF_CLASSES[cfg.model_type]
    torch.manual_seed(0)
    hf = model_class(config_class(**cfg.to_hf())).eval()
    with torch.no_grad():  # norms off 1, so that a missing q/k norm shows; experts and router not tiny
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.05)
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path)  # the kind from config.json's model_type
    assert model.cfg == cfg
    return hf, model


def test_qwen3_matches_transformers(twins):
    hf, model = twins
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    hidden = model.forward_cached(ids, model.new_cache(*ids.shape))
    with torch.inference_mode():
        assert rel_err(model.norm(hidden), out.hidden_states[-1]) <= 1e-4
        assert rel_err(model.logits(hidden), out.logits) <= 1e-4
    packed, _ = model.forward_packed(ids.flatten(), cu_seqlens_of([29, 29]))
    with torch.inference_mode():
        assert rel_err(model.logits(packed), out.logits.flatten(0, 1)) <= 1e-4


def test_qwen3_greedy_decoding_is_transformers(twins):
    hf, model = twins
    prompts = [[5, 17, 33, 2, 9], [44, 1, 200]]
    ours = generate(model, prompts, max_new_tokens=12, eos_ids=[])
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert tokens == ref[0, len(prompt) :].tolist()


def test_the_registry_builds_qwen3_round_trip(tmp_path):
    """Random weights → Hugging Face names → our loader, the kind found by its model_type."""
    cfg = CONFIGS["untied-mha"]
    model = random_qwen3(cfg, seed=3)
    state = TARGET_KINDS["qwen3"].hf_state_dict(model)
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (cfg.head_dim,)
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert read_target_config(tmp_path) == cfg
    loaded = load_target(tmp_path)
    assert type(loaded).__name__ == "Qwen3Model"
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_unsupported_qwen3_options_are_refused():
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3Config.from_hf({**CONFIGS["tied"].to_hf(), "use_sliding_window": True})


EAGLE3 = ("precompute.aux=true", "model.aux_layers=[0,1]", "export.formats=[native,eagle3,speculators]")


@pytest.mark.parametrize(
    "kind, variant",
    [
        ("qwen3", "rmsnorm-restored"),
        ("qwen3", "eagle1"),
        ("qwen3", "eagle3"),
        ("qwen3_moe", "rmsnorm-restored"),
    ],
)
def test_a_head_trains_validates_and_exports_on_a_qwen3_target(smollm2, tmp_path, kind, variant):
    target = write_random_target(tmp_path / "target", smollm2, seed=0, kind=kind)
    overrides = [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        f"model.variant={variant}",
        f"run_dir={tmp_path / 'run'}",
        f"data.train_files=[{REPO / 'tests/data/gsm8k_64.jsonl'}]",
        "data.max_samples=16",
        "train.steps=4",
        "train.unroll_steps=2",
        "train.tokens_per_micro_batch=512",
        "train.save_every=0",
        f"validate.eval_files=[{REPO / 'data/mt_bench.jsonl'}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=10",
        "validate.chain_lengths=[2]",
        "validate.temperatures=[0.0]",
        "validate.teacher_forced_samples=2",
        "export.dtype=float32",
        *(EAGLE3 if variant == "eagle3" else ()),
    ]
    cfg = recipe(overrides)
    run_precompute(cfg)
    train(cfg)
    report = run_validation(cfg)
    assert_serves_as_trained(report, k=2)
    written = export(cfg)
    config_ = json.loads((written["native"] / "config.json").read_text())
    assert config_["layer_config"]["model_type"] == kind
    assert config_["architecture"] == {"qwen3": "Qwen3MTPHead", "qwen3_moe": "Qwen3MoeMTPHead"}[kind]
    if variant == "eagle3":  # the engines' draft layer is a Llama layer on a Qwen3 target too
        engine = json.loads((written["eagle3"] / "config.json").read_text())
        assert engine["model_type"] == "llama" and engine["architectures"] == ["LlamaForCausalLMEagle3"]
        speculators = json.loads((written["speculators"] / "config.json").read_text())
        assert speculators["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
