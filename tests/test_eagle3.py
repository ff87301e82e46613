"""EAGLE-3 heads: captured target states, the aux store, training → serving parity, the engine
layouts, and vLLM's `speculators` package loading our export and computing our logits."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.draft import load_draft
from inference_ref.generate import prefill
from inference_ref.head_files import read_head_files
from inference_ref.head_spec import HeadSpec, default_aux_layers
from inference_ref.target import load_target
from mtp_train.export import export
from mtp_train.layer_names import EAGLE3_LATER_BLOCK
from mtp_train.precompute import run_precompute
from mtp_train.serving.layouts import (
    LayoutUnsupported,
    deepseek_mtp_export,
    eagle1_export,
    eagle3_export,
    eagle3_layout,
    speculators_export,
)
from mtp_train.target_files import write_random_target
from mtp_train.train import train
from mtp_train.validate import run_validation
from tiny import (
    assert_chains_match_training,
    assert_serves_as_trained,
    assert_tau_consistent,
    frozen_of,
    randomized,
    recipe,
    supervised_counts,
    tiny_deepseek,
    tiny_llama,
)

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "tests" / "data" / "gsm8k_64.jsonl"
MT_BENCH = REPO / "data" / "mt_bench.jsonl"
AUX = [1, 2, 3]  # on a 4-layer target (the default 2, L/2, L − 3 needs L ≥ 6)
DRAFT_VOCAB = 2048


@pytest.fixture(scope="module")
def deep_target(smollm2, tmp_path_factory):
    """A 4-layer random Llama (untied lm_head) with SmolLM2's tokenizer."""
    out = tmp_path_factory.mktemp("deep_target")
    return write_random_target(out, smollm2, seed=1, num_hidden_layers=4, tie_word_embeddings=False)


def eagle3_overrides(target: Path, run: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        "model.dtype=float32",
        "model.variant=eagle3",
        f"model.aux_layers={AUX}",
        f"model.draft_vocab_size={DRAFT_VOCAB}",
        "precompute.aux=true",
        f"run_dir={run}",
        f"data.train_files=[{GSM8K}]",
        "data.max_samples=24",
        "train.steps=8",
        "train.unroll_steps=2",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.tokens_per_micro_batch=512",
        "train.save_every=0",
        "logging.log_every=1",
        f"validate.eval_files=[{MT_BENCH}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=12",
        "validate.chain_lengths=[2]",
        "validate.teacher_forced_samples=2",
        "export.formats=[native,eagle3,speculators]",
        "export.dtype=float32",
        *extra,
    ]


@pytest.fixture(scope="module")
def pipeline(deep_target, tmp_path_factory):
    """Precompute with aux states, train an eagle3 head (unroll 2, draft vocabulary), validate, export."""
    run = tmp_path_factory.mktemp("eagle3_run")
    cfg = recipe(eagle3_overrides(deep_target, run))
    store = run_precompute(cfg)
    train(cfg)
    report = run_validation(cfg)
    return {"cfg": cfg, "store": store, "report": report, "exported": export(cfg), "run": run}


def test_captured_states_are_the_hugging_face_hidden_states(deep_target):
    """`capture` id k is HF's hidden_states[k] (the state entering layer k), packed and cached alike."""
    model = load_target(deep_target)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(deep_target), dtype=torch.float32).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    capture = (0, 1, 2, 3)
    packed, _ = model.forward_packed(ids[0], cu_seqlens_of([37]), capture=capture)
    h = model.cfg.hidden_size
    assert packed.shape == (37, 5 * h)
    for j, k in enumerate(capture):
        torch.testing.assert_close(packed[:, (1 + j) * h : (2 + j) * h], states[k][0], rtol=1e-4, atol=1e-5)
    _, cached = prefill(model, [ids[0].tolist()], 40, capture)
    torch.testing.assert_close(cached[0], packed, rtol=1e-4, atol=1e-5)
    # The first H columns stay the last layer's state: logits are unchanged by capturing.
    torch.testing.assert_close(
        model.logits(packed), model.logits(model.forward_packed(ids[0], cu_seqlens_of([37]))[0])
    )


def test_the_store_keeps_the_aux_states_and_training_uses_them(pipeline):
    manifest = json.loads((pipeline["store"] / "manifest.json").read_text())
    assert manifest["aux_layers"] == AUX
    assert manifest["bytes_per_token"] == 2 * 64 * (1 + len(AUX)) + 5
    rows = [json.loads(x) for x in (pipeline["run"] / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(math.isfinite(r["loss"]) and math.isfinite(r["step2/ce"]) for r in rows)
    # EAGLE-3 has no feature regression: the loss is the two chained steps' CE alone (decay 0.8).
    assert all(math.isclose(r["loss"], r["ce"] + 0.8 * r["step2/ce"], rel_tol=1e-4) for r in rows)
    assert rows[-1]["ce"] < rows[0]["ce"], [r["ce"] for r in rows]


def test_eagle3_validates_through_the_serving_loop(pipeline):
    # fp32 on CPU: the training module (precompute path) and the serving draft (cache path) agree.
    assert_serves_as_trained(pipeline["report"], k=2)
    assert_tau_consistent(pipeline["report"]["speculative"]["T=1"]["k=2"], k=2)


def test_native_export_carries_the_draft_vocabulary(pipeline, deep_target):
    native = pipeline["exported"]["native"]
    config_ = json.loads((native / "config.json").read_text())
    assert config_["variant"] == "eagle3" and config_["aux_layers"] == AUX
    assert config_["draft_vocab_size"] == DRAFT_VOCAB
    tensors = load_file(str(native / "head.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (DRAFT_VOCAB,)
    ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert bool((ids[1:] > ids[:-1]).all())  # increasing target ids
    # The draft vocabulary is the store's most frequent supervised tokens.
    from mtp_train.store import Store

    counts = supervised_counts(Store(pipeline["store"]), 49152)
    assert counts[ids].min() >= counts[~torch.isin(torch.arange(49152), ids)].max()
    draft = load_draft(native, load_target(deep_target))
    assert draft.capture == tuple(AUX) and torch.equal(draft.draft_ids, ids)


def test_eagle3_layout_names_shapes_and_config(pipeline):
    """Against the table read from SGLang/vLLM/TensorRT-LLM's `LlamaForCausalLMEagle3` loaders
    (mtp_train/engine_layouts.py cites files and commits)."""
    out = pipeline["exported"]["eagle3"]
    tensors = load_file(str(out / "model.safetensors"))
    h, v, qd, kvd = 64, 49152, 4 * 16, 2 * 16
    expected = {
        "midlayer.self_attn.q_proj.weight": (qd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kvd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kvd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, qd),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (128, h),
        "midlayer.mlp.up_proj.weight": (128, h),
        "midlayer.mlp.down_proj.weight": (h, 128),
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
        "lm_head.weight": (DRAFT_VOCAB, h),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (v,),
    }
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == DRAFT_VOCAB
    assert bool(tensors["t2d"][torch.arange(DRAFT_VOCAB) + tensors["d2t"]].all())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == h
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM: the state entering layer k
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in AUX]  # SGLang adds 1


BIAS_KEYS = ("bias", "attention_bias", "qkv_bias", "o_proj_bias")


def truthy_bias_keys(config_: dict, where: str = "") -> list[str]:
    """Keys an engine's Llama layer reads as "the attention projections have biases", where truthy."""
    found = []
    for key, value in config_.items():
        if isinstance(value, dict):
            found += truthy_bias_keys(value, f"{where}{key}.")
        elif key in BIAS_KEYS and value:
            found.append(where + key)
    return found


def test_no_layout_config_turns_on_attention_biases(pipeline):
    for name in ("eagle3", "speculators"):
        cfg = json.loads((pipeline["exported"][name] / "config.json").read_text())
        assert truthy_bias_keys(cfg) == [], name
    llama = tiny_llama().to_hf()
    block = {
        "layer.self_attn.q_proj.weight": torch.zeros(64, 64),
        "layer.self_attn.k_proj.weight": torch.zeros(32, 64),
        "layer.self_attn.v_proj.weight": torch.zeros(32, 64),
        "layer.self_attn.o_proj.weight": torch.zeros(64, 64),
        "layer.post_attention_layernorm.weight": torch.zeros(64),
        "layer.mlp.gate_proj.weight": torch.zeros(128, 64),
        "layer.mlp.up_proj.weight": torch.zeros(128, 64),
        "layer.mlp.down_proj.weight": torch.zeros(64, 128),
    }
    eagle1 = eagle1_export(
        {"fc.weight": torch.zeros(64, 128), "fc.bias": torch.zeros(64), **block}, llama, "eagle1"
    )
    assert truthy_bias_keys(eagle1.config) == [] and "fc.bias" in eagle1.tensors
    assert truthy_bias_keys({"a": {"bias": True}}) == ["a.bias"]  # the check itself can fail
    from test_export import DEEPSEEK, synthetic_deepseek_head

    assert (
        truthy_bias_keys(
            deepseek_mtp_export(synthetic_deepseek_head(DEEPSEEK), DEEPSEEK, "rmsnorm-restored").config
        )
        == []
    )


def test_eagle3_is_refused_where_it_cannot_be_built_or_exported(deep_target, tmp_path):
    with pytest.raises(ValueError, match="built for"):
        HeadSpec("eagle3", tiny_deepseek(), aux_layers=(0, 1, 2))
    with pytest.raises(ValueError, match="increasing distinct"):
        HeadSpec("eagle3", tiny_llama(num_hidden_layers=4), aux_layers=(2, 2, 1))
    with pytest.raises(LayoutUnsupported, match="EAGLE-3"):
        eagle3_export({}, HeadSpec("rmsnorm-restored", tiny_llama()), {})
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B: vLLM's and SGLang's default
    # A store made without the aux states: the eagle3 head is refused with the override that adds them.
    run = tmp_path / "run"
    cfg = recipe(eagle3_overrides(deep_target, run, "precompute.aux=false", "train.steps=1"))
    run_precompute(cfg)
    with pytest.raises(ValueError, match=r"precompute.aux=true model.aux_layers=\[1, 2, 3\]"):
        train(cfg)


# ------------------------------------------------------------------ the real client: speculators


def test_speculators_loads_our_export_and_computes_our_logits(pipeline, deep_target):
    """vLLM's `speculators` package (0.9.0, installed by scripts/setup.sh) parses our config,
    loads our weights with no missing or unexpected key, and its EAGLE-3 draft model gives our
    serving draft's logits on the same token ids and aux states (fp32)."""
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers.utils import logging as hf_logging

    out = pipeline["exported"]["speculators"]
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(out))
    # speculators accepts unknown keys silently: assert the values that matter.
    assert cfg.draft_vocab_size == DRAFT_VOCAB and cfg.eagle_aux_hidden_state_layer_ids == AUX
    assert cfg.norm_before_residual is False and cfg.target_hidden_size == 64
    assert type(cfg.transformer_layer_config).__name__ == "LlamaConfig"
    assert cfg.transformer_layer_config.hidden_size == 64 and cfg.transformer_layer_config.vocab_size == 49152
    assert Path(cfg.speculators_config.verifier.name_or_path) == Path(deep_target).resolve()
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path here

    reports = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: reports.append(record.getMessage())
    logger = hf_logging.get_logger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        model = Eagle3DraftModel.from_pretrained(
            str(out), config=cfg, local_files_only=True, dtype=torch.float32
        )
    finally:
        logger.removeHandler(handler)
    model.eval()
    assert not [r for r in reports if "LOAD REPORT" in r], reports
    ckpt = load_file(str(out / "model.safetensors"))
    verifier_only = {"verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(ckpt) == set(model.state_dict()) - verifier_only
    state = model.state_dict()
    assert all(torch.equal(state[n].to(t.dtype), t) for n, t in ckpt.items())

    target = load_target(deep_target)
    draft = load_draft(pipeline["exported"]["native"], target)
    ids = torch.randint(0, 49152, (1, 21), generator=torch.Generator().manual_seed(3))
    _, hidden = prefill(target, [ids[0].tolist()], 21, draft.capture)
    y = draft.prefill(hidden[:, :-1], ids[:, 1:], draft.new_cache(1, 21))
    ours = draft.logits(y)[0][:, draft.draft_ids]  # our draft's scores of the draft vocabulary

    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        model(
            hidden_states=hidden[:, :-1, 64:],  # the aux states, in manifest order
            input_ids=ids[:, 1:],
            document_ids=torch.zeros_like(ids[:, 1:]),
            position_ids=torch.arange(20)[None],  # entry i sits at rope position i, as ours
            ttt_steps=1,
        )
    hook.remove()
    theirs = captured[0][0]
    rel = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert rel <= 1e-4, rel


def test_an_eagle3_run_resumes_from_its_checkpoint(deep_target, tmp_path):
    """The checkpoint keeps the head's persistent buffers (d2t), and resuming checks the draft
    vocabulary the store gives against the checkpoint's."""
    cfg = recipe(eagle3_overrides(deep_target, tmp_path, "train.steps=4", "train.save_every=2"))
    run_precompute(cfg)
    train(cfg)
    assert (tmp_path / "train" / "ckpt-0000004").exists()
    train(recipe(eagle3_overrides(deep_target, tmp_path, "train.steps=6", "train.save_every=2")))
    rows = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_eagle3_1_trains_serves_as_trained_and_exports_for_vllm(pipeline, tmp_path):
    """EAGLE-3.1 (fc_norm on each auxiliary state, chained steps fed norm(y)): trained on the
    eagle3 store, the serving draft agrees with the training module, and the `vllm` layout is the
    eagle3 one with vLLM's two switches on and the per-state norms under vLLM's names (vLLM itself
    serves it in tests/test_vllm.py)."""
    from mtp_train.validate import run_validation

    cfg = recipe(
        eagle3_overrides(
            pipeline["cfg"].model.target,
            tmp_path,
            "model.variant=eagle3.1",
            f"precompute.store_dir={pipeline['store']}",
            "export.formats=[native,vllm]",
        )
    )
    train(cfg)
    report = run_validation(cfg)
    assert_serves_as_trained(report, k=2)
    exported = export(cfg)
    native = load_file(str(exported["native"] / "head.safetensors"))
    norms = [native[f"fc_norm.{i}.weight"] for i in range(len(AUX))]
    assert all(n.shape == (64,) and not torch.equal(n, torch.ones(64)) for n in norms)  # trained
    config_ = json.loads((exported["vllm"] / "config.json").read_text())
    assert config_["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config_["fc_norm"] is True and config_["norm_output"] is True
    held = load_file(str(exported["vllm"] / "model.safetensors"))
    assert all(torch.equal(held[f"fc_norm.{i}.weight"], norms[i]) for i in range(len(AUX)))
    with pytest.raises(ValueError, match="layout eagle3 is not listed for eagle3.1 heads"):
        export(recipe(eagle3_overrides(pipeline["cfg"].model.target, tmp_path, "model.variant=eagle3.1")))


def test_a_stacked_eagle3_1_head_trains_serves_as_trained_and_round_trips(pipeline, tmp_path):
    """model.draft_layers=2: a Llama layer over H after EAGLE-3's first, at every chained step (vLLM's
    llama_eagle3.py, layer_idx ≥ 1). The serving draft agrees with the training module; the vllm
    (EAGLE-3) layout holds `layers.1.*` with the unused hidden_norm vLLM loads strictly (ones), says
    num_hidden_layers 2, and reads back as the native head (vLLM itself serves such a head in
    tests/test_vllm.py). The kinds that cannot stack, and the speculators layout, refuse it."""
    cfg = recipe(
        eagle3_overrides(
            pipeline["cfg"].model.target,
            tmp_path,
            "model.variant=eagle3.1",
            "model.draft_layers=2",
            f"precompute.store_dir={pipeline['store']}",
            "export.formats=[native,vllm]",
        )
    )
    train(cfg)
    report = run_validation(cfg)
    assert_serves_as_trained(report, k=2)
    chain = report["speculative"]["greedy"]["k=2"]
    assert chain["draft_layer_passes"] == 4  # two steps, two layers each
    assert chain["draft_vocab_size"] == DRAFT_VOCAB  # what mtp_train.projection costs its lm_head by
    exported = export(cfg)
    native = load_file(str(exported["native"] / "head.safetensors"))
    later = {n for n in native if n.startswith("later_layers.")}
    assert later == {f"later_layers.0.{n}" for n in EAGLE3_LATER_BLOCK}
    assert native["later_layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # reads H, not 2H
    config_ = json.loads((exported["vllm"] / "config.json").read_text())
    assert config_["num_hidden_layers"] == 2
    held = load_file(str(exported["vllm"] / "model.safetensors"))
    assert torch.equal(held["layers.1.hidden_norm.weight"], torch.ones(64))
    assert torch.equal(held["layers.1.mlp.down_proj.weight"], native["later_layers.0.mlp.down_proj.weight"])
    _, back = read_head_files(exported["vllm"])
    assert sorted(back) == sorted(native) and all(torch.equal(back[n], native[n]) for n in native)
    spec = HeadSpec("eagle3", tiny_llama(num_hidden_layers=4), aux_layers=AUX, layers=2)
    with pytest.raises(LayoutUnsupported, match="stacks 2 layers"):
        speculators_export({}, spec, {})
    for kind in ("rmsnorm-restored", "eagle1"):
        with pytest.raises(ValueError, match="eagle3 and eagle3.1 heads may stack more"):
            HeadSpec(kind, tiny_llama(), layers=2)
    with pytest.raises(LayoutUnsupported, match=r"export.formats=\[vllm\]"):  # SGLang, TensorRT-LLM
        eagle3_layout({}, spec, {})


@pytest.mark.parametrize("variant,kind", [("eagle3", "llama"), ("eagle3.1", "llama"), ("eagle3.1", "qwen3")])
def test_stacked_chained_steps_equal_the_training_head(variant, kind, tmp_path):
    """Two stacked layers, chained from several bases at once: every step of the serving draft (one
    cache layer per decoder layer, shifted) equals the training head's unrolled steps (one chain KV
    per layer), states and logits; on a Qwen3 target too (its draft layers are Llama's)."""
    from inference_ref.causal_lm import packed_positions
    from inference_ref.models import TARGET_KINDS
    from mtp_train.export import save_head
    from mtp_train.head_attention import Segments
    from mtp_train.heads import build

    registry = TARGET_KINDS[kind]
    cfg = registry.config(**{"vocab_size": 256, **registry.tiny, "num_hidden_layers": 4})
    target = registry.random(cfg, "cpu", torch.float32, 0)
    head = randomized(
        build(HeadSpec(variant, cfg, aux_layers=tuple(AUX), layers=2), frozen_of(target)), seed=1
    )
    steps, n = 3, 16
    seq = torch.randint(0, cfg.vocab_size, (n + steps,), generator=torch.Generator().manual_seed(1))
    cu = cu_seqlens_of([n])
    hidden, _ = target.forward_packed(seq[:n], cu, capture=tuple(AUX))
    tokens = torch.stack([seq[1 + j : n + 1 + j] for j in range(steps)])
    with torch.no_grad():
        ref_y = head(hidden.clone(), tokens, packed_positions(cu, n), Segments(cu, n), steps)
        ref_logits = head.logits(head.output_state(ref_y))

    identity = {"path": "", "config_hash": cfg.fingerprint()}
    draft = load_draft(save_head(head, tmp_path / "head", identity, {}, torch.float32), target)
    assert len(draft.later_layers) == 1
    assert_chains_match_training(draft, hidden, tokens, ref_y, ref_logits)
