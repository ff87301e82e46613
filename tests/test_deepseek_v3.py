"""DeepSeek-V3 targets: parity with transformers' DeepseekV3ForCausalLM (V3's sigmoid, bias-corrected,
group-limited routing) on a tiny random config (fp32), greedy decoding, and a nextn head started from
the MTP layer the checkpoint ships, trained, validated and exported in the DeepSeek MTP layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.generate import generate
from inference_ref.head_spec import HeadSpec
from inference_ref.models import TARGET_KINDS
from inference_ref.models.deepseek_v3 import DeepseekV3Config
from inference_ref.target import frozen_target_tensors, load_target, read_target_config
from mtp_train.export import export, head_tensors
from mtp_train.heads import MTPHead
from mtp_train.precompute import run_precompute
from mtp_train.run import Target
from mtp_train.serving.layouts import to_deepseek_mtp
from mtp_train.target_files import write_random_target
from mtp_train.train import build_head, train
from mtp_train.validate import run_validation
from tiny import assert_tau_consistent, recipe, rel_err

REPO = Path(__file__).resolve().parent.parent
CFG = DeepseekV3Config(vocab_size=256, **TARGET_KINDS["deepseek_v3"].tiny)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CFG.to_hf())).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.05)
        for name, b in hf.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)  # the bias must steer the choice for the test to see it
    out = tmp_path_factory.mktemp("v3")
    hf.save_pretrained(out)
    return hf, load_target(out)


def test_deepseek_v3_matches_transformers(twins):
    hf, model = twins
    assert model.cfg == CFG and model.layers[1].mlp.router.e_score_correction_bias.abs().sum() > 0
    ids = torch.randint(0, 256, (2, 31), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    hidden = model.forward_cached(ids, model.new_cache(*ids.shape))
    packed, _ = model.forward_packed(ids.flatten(), cu_seqlens_of([31, 31]))
    with torch.inference_mode():
        assert rel_err(model.logits(hidden), ref) <= 1e-4
        assert rel_err(model.logits(packed), ref.flatten(0, 1)) <= 1e-4
        # the correction bias changes which experts are chosen: without it the output differs
        saved = model.layers[1].mlp.router.e_score_correction_bias.clone()
        model.layers[1].mlp.router.e_score_correction_bias.zero_()
        assert rel_err(model.logits(model.forward_cached(ids, model.new_cache(*ids.shape))), ref) > 1e-4
        model.layers[1].mlp.router.e_score_correction_bias.copy_(saved)


def test_deepseek_v3_greedy_decoding_is_transformers(twins):
    hf, model = twins
    prompts = [[5, 17, 33, 2, 9], [44, 1, 200]]
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=10, eos_ids=[])):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert tokens == ref[0, len(prompt) :].tolist()


def test_fp8_block_scaled_checkpoints_load_as_they_are(tmp_path):
    """DeepSeek-V3's hub format: e4m3 weights with one scale per 128×128 tile (`weight_scale_inv`)
    and a `quantization_config`; read tile by tile into the model's weights."""
    model = TARGET_KINDS["deepseek_v3"].random(CFG, seed=0)
    weights = {k: v.contiguous() for k, v in TARGET_KINDS["deepseek_v3"].hf_state_dict(model).items()}
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    w = weights[name]
    scale = w.abs().amax().reshape(1, 1) / 448.0  # one tile: this tiny weight is < 128 × 128
    weights[name] = (w / scale).to(torch.float8_e4m3fn)
    weights[name + "_scale_inv"] = scale.float()
    save_file(weights, str(tmp_path / "model.safetensors"))
    hf = {**CFG.to_hf(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = load_target(tmp_path)
    got = loaded.layers[1].self_attn.kv_b_proj.weight
    assert torch.allclose(got, w, rtol=0.07, atol=scale.item() * 16)  # e4m3: 3 mantissa bits
    assert not torch.equal(got, w)  # it did go through FP8
    with pytest.raises(ValueError, match="128×128"):
        DeepseekV3Config.from_hf(
            {**CFG.to_hf(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}}
        )


def test_a_nextn_head_starts_from_the_shipped_mtp_layer_trains_and_exports(smollm2, tmp_path):
    target = write_random_target(tmp_path / "target", smollm2, seed=0, kind="deepseek_v3")
    # Give the checkpoint an MTP layer, as DeepSeek-V3 ships one: a random head in the engines' layout.
    cfg = read_target_config(target)
    torch.manual_seed(7)
    shipped = MTPHead(HeadSpec("rmsnorm-restored", cfg, "moe"), frozen_target_tensors(target))
    with torch.no_grad():
        for p in shipped.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    weights = load_file(str(target / "model.safetensors"))
    weights.update(to_deepseek_mtp(head_tensors(shipped, torch.float32, False), cfg.num_hidden_layers))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})

    overrides = [
        "model=tiny_deepseek_v2",
        f"model.target={target}",
        "model.dtype=float32",
        "model.head_mlp=moe",
        "model.init_from_target_mtp=true",
        f"run_dir={tmp_path / 'run'}",
        f"data.train_files=[{REPO / 'tests/data/gsm8k_64.jsonl'}]",
        "data.max_samples=16",
        "train.steps=4",
        "train.unroll_steps=2",
        "train.save_every=0",
        f"validate.eval_files=[{REPO / 'data/mt_bench.jsonl'}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=10",
        "validate.chain_lengths=[2]",
        "validate.temperatures=[0.0]",
        "validate.teacher_forced_samples=2",
        "export.formats=[native,deepseek_mtp]",
        "export.dtype=float32",
    ]
    run_cfg = recipe(overrides)
    started = build_head(run_cfg.model, Target.resolve(str(target)), torch.float32)
    a, b = started.state_dict(), shipped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    run_precompute(run_cfg)
    train(run_cfg)
    report = run_validation(run_cfg)
    greedy = report["speculative"]["greedy"]["k=2"]
    assert greedy["identical_to_target_greedy"]
    assert_tau_consistent(greedy, k=2)
    written = export(run_cfg)
    engine = json.loads((written["deepseek_mtp"] / "config.json").read_text())
    assert engine["model_type"] == "deepseek_v3" and engine["num_nextn_predict_layers"] == 1
    names = load_file(str(written["deepseek_mtp"] / "model.safetensors"))
    assert f"model.layers.{cfg.num_hidden_layers}.mlp.gate.e_score_correction_bias" in names
