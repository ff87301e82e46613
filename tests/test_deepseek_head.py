"""The DeepSeek-kind head (an MLA layer, dense MLP or the target's MoE block) on DeepSeek-V2 targets:
the training module against the serving draft, the speculative loop against the target alone, the
whole pipeline on a tiny random DeepSeek-V2, the MoE head's training step and engine export, and
heads refused by a target of the other kind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mtp_train.export as ex
from inference_ref.causal_lm import cu_seqlens_of, packed_positions
from inference_ref.draft import MTPDraft, load_draft
from inference_ref.generate import generate
from inference_ref.head_spec import HeadSpec
from inference_ref.models import TARGET_KINDS
from inference_ref.models import deepseek_v2 as ds
from inference_ref.models.deepseek_v2 import DeepseekV2Config, DeepseekV2Model
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.target import frozen_target_tensors, load_target, read_target_config
from mtp_train.batching import collate
from mtp_train.export import export
from mtp_train.head_attention import Segments
from mtp_train.heads import MTPHead
from mtp_train.layer_names import check_layout
from mtp_train.losses import DraftObjective, LossWeights
from mtp_train.precompute import run_precompute
from mtp_train.serving.layouts import deepseek_is_moe, deepseek_mtp_table
from mtp_train.target_files import target_identity, write_random_target
from mtp_train.train import train
from mtp_train.validate import run_validation
from tiny import (
    assert_chains_match_training,
    assert_serves_as_trained,
    frozen_of,
    randomized,
    recipe,
    rel_err,
)

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["rmsnorm-restored", "eagle1"]
MLPS = ["dense", "moe"]
CONFIGS = {
    "lite": DeepseekV2Config(vocab_size=256, **TARGET_KINDS["deepseek_v2"].tiny),
    "q-lora": DeepseekV2Config(vocab_size=256, **TARGET_KINDS["deepseek_v2"].tiny, q_lora_rank=24),
}


def random_head(
    target: DeepseekV2Model, variant: str, seed: int = 0, scale: float = 0.1, mlp: str = "dense"
) -> MTPHead:
    """Every trainable tensor random (norms around 1), so each part of the math shows in the output."""
    torch.manual_seed(seed)
    return randomized(MTPHead(HeadSpec(variant, target.cfg, mlp), frozen_of(target)), scale=scale)


def serve(head: MTPHead, target: DeepseekV2Model, tmp_path: Path) -> MTPDraft:
    """Through the native format: the trainer's writer, the server's reader."""
    identity = {"path": "", "config_hash": target.cfg.fingerprint()}
    return load_draft(ex.save_head(head, tmp_path / "head", identity, {}, torch.float32), target)


# ---------------------------------------------------------------- train/serve parity of the head


@pytest.mark.parametrize("mlp", MLPS)
@pytest.mark.parametrize("shape", list(CONFIGS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_logits_equal_training_head(variant, shape, mlp, tmp_path):
    """Draft prefill (latent cache, absorbed weights) on a batch = MTPHead (per-head K/V, packed), fp32."""
    target = ds.random_deepseek_v2(CONFIGS[shape], seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (21, 8, 33)]
    lengths = [len(s) for s in seqs]
    cu = cu_seqlens_of(lengths)
    hidden, _ = target.forward_packed(torch.cat(seqs), cu)
    next_tokens = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs])  # last one arbitrary
    head = random_head(target, variant, mlp=mlp)
    with torch.no_grad():
        ref_y = head(hidden.clone(), next_tokens[None], packed_positions(cu, len(hidden)), Segments(cu, 33))[
            0
        ]

    draft = serve(head, target, tmp_path)
    padded = torch.nn.utils.rnn.pad_sequence
    y = draft.prefill(
        padded(list(hidden.split(lengths)), batch_first=True),
        padded(list(next_tokens.split(lengths)), batch_first=True),
        draft.new_cache(len(seqs), max(lengths)),
    )
    y = torch.cat([y[b, :n] for b, n in enumerate(lengths)])
    assert rel_err(y, ref_y) <= 1e-4
    assert rel_err(draft.logits(y), head.logits(head.output_state(ref_y))) <= 1e-4


@pytest.mark.parametrize("mlp", MLPS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_chained_steps_equal_training_head(variant, mlp, tmp_path):
    """Chained drafting from several bases at once (shifted latent cache) = MTPHead's unrolled steps."""
    target = ds.random_deepseek_v2(CONFIGS["lite"], seed=1)
    steps, n = 3, 16
    seq = torch.randint(0, 256, (n + steps,), generator=torch.Generator().manual_seed(1))
    cu = cu_seqlens_of([n])
    hidden, _ = target.forward_packed(seq[:n], cu)
    tokens = torch.stack([seq[1 + j : n + 1 + j] for j in range(steps)])
    head = random_head(target, variant, seed=1, mlp=mlp)
    with torch.no_grad():
        ref_y = head(hidden.clone(), tokens, packed_positions(cu, n), Segments(cu, n), steps)
        ref_logits = head.logits(head.output_state(ref_y))

    assert_chains_match_training(serve(head, target, tmp_path), hidden, tokens, ref_y, ref_logits)


# ---------------------------------------------------------------- greedy: identical to the target alone


def bigram_pair(
    tmp_path: Path, context: float = 0.03, mlp: str = "dense"
) -> tuple[DeepseekV2Model, MTPDraft]:
    """A 64-token DeepSeek-V2 that is mostly a bigram model (large embeddings, small attention and
    MLP outputs), and a head whose fc passes the token's embedding through: a good, imperfect draft."""
    shape = {
        **TARGET_KINDS["deepseek_v2"].tiny,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
    }
    target = ds.random_deepseek_v2(DeepseekV2Config(vocab_size=64, **shape), seed=0)
    with torch.no_grad():
        target.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.normal_(0, 1.0)
        for name, p in target.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.normal_(0, context)
    torch.manual_seed(1)
    head = MTPHead(HeadSpec("rmsnorm-restored", target.cfg, mlp), frozen_of(target))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.03)
        head.fc.weight[:, :32] += torch.eye(32)
    return target, serve(head, target, tmp_path)


@pytest.mark.parametrize("mlp", MLPS)
def test_greedy_speculative_equals_target_alone(mlp, tmp_path):
    """Rows accept different numbers of tokens per step: per-row commits of both latent caches."""
    target, draft = bigram_pair(tmp_path, mlp=mlp)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 17, 1, 6, 30)]
    eos = [5]
    expected = generate(target, prompts, 32, eos)
    for k in (1, 3):
        out = speculative_generate(target, draft, prompts, 32, eos, Chain(k))
        assert out.tokens == expected, k
        assert out.stats.accept_rate[0] > 0.3 and out.stats.mean_accepted_len > 1.3


# ---------------------------------------------------------------- the pipeline on a tiny DeepSeek-V2


@pytest.fixture(scope="module")
def tiny_deepseek(smollm2, tmp_path_factory):
    """A 2-layer random DeepSeek-V2 with SmolLM2's tokenizer and chat template."""
    return write_random_target(tmp_path_factory.mktemp("tiny_deepseek"), smollm2, kind="deepseek_v2")


def test_tiny_target_loads_by_kind(tiny_deepseek, tiny_target):
    assert isinstance(load_target(tiny_deepseek), DeepseekV2Model)
    assert read_target_config(tiny_target).model_type == "llama"
    frozen = frozen_target_tensors(tiny_deepseek)  # untied: its own lm_head
    assert not torch.equal(frozen["lm_head.weight"], frozen["model.embed_tokens.weight"])


def test_pipeline_on_a_tiny_deepseek_v2(tiny_deepseek, tmp_path):
    """precompute → train (2 chained steps) → validate (fp32: greedy identical to the target) →
    export (native and the DeepSeek MTP layout)."""
    overrides = [
        "model=tiny_deepseek_v2",
        f"model.target={tiny_deepseek}",
        "model.dtype=float32",
        f"run_dir={tmp_path}",
        f"data.train_files=[{REPO / 'tests/data/gsm8k_64.jsonl'}]",
        "data.max_samples=24",
        "train.steps=8",
        "train.unroll_steps=2",
        "train.lr=3e-3",
        "train.warmup_steps=1",
        "train.save_every=0",
        "logging.log_every=1",
        f"validate.eval_files=[{REPO / 'data/mt_bench.jsonl'}]",
        "validate.num_prompts=2",
        "validate.max_new_tokens=12",
        "validate.chain_lengths=[2]",
        "validate.temperatures=[0.0]",
        "validate.teacher_forced_samples=2",
        "export.formats=[native,deepseek_mtp]",
        "export.dtype=float32",
    ]
    cfg = recipe(overrides)
    run_precompute(cfg)
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in rows]
    assert len(loss) == 8 and all(math.isfinite(r["ce"]) and math.isfinite(r["step2/ce"]) for r in rows)
    assert sum(loss[-2:]) < sum(loss[:2]) - 0.02, loss  # the target is near uniform: SmoothL1 moves most

    report = run_validation(cfg)
    assert_serves_as_trained(report, k=2)
    assert report["speculative"]["greedy"]["k=2"]["identical_answers"] == 1.0
    assert (tmp_path / "validate" / "report.json").exists()

    written = export(cfg)
    native = json.loads((written["native"] / "config.json").read_text())
    assert native["architecture"] == "DeepseekV2MTPHead"
    assert native["layer_config"]["model_type"] == "deepseek_v2"
    head = load_file(written["native"] / "head.safetensors")
    tensors = load_file(written["deepseek_mtp"] / "model.safetensors")
    config = json.loads((written["deepseek_mtp"] / "config.json").read_text())
    check_layout(tensors, deepseek_mtp_table(config, store_shared=False), "deepseek_mtp")
    # The head's dense MLP: layer N = 2 must be below first_k_dense_replace for vLLM to build it dense.
    assert config["num_hidden_layers"] == 2 and config["first_k_dense_replace"] == 3
    assert tensors["model.layers.2.mlp.gate_proj.weight"].shape == (128, 64)
    assert torch.equal(tensors["model.layers.2.eh_proj.weight"], head["fc.weight"])
    assert torch.equal(
        tensors["model.layers.2.self_attn.kv_b_proj.weight"], head["layer.self_attn.kv_b_proj.weight"]
    )


# ---------------------------------------------------------------- a head for the other kind of target


def test_a_head_for_another_kind_of_target_is_refused(tiny_deepseek, tiny_target, tmp_path):
    """Both have hidden size 64 and SmolLM2's vocabulary: only the kind tells them apart."""
    heads = {}
    for name, target_dir in (("llama", tiny_target), ("deepseek_v2", tiny_deepseek)):
        head = MTPHead(
            HeadSpec("rmsnorm-restored", read_target_config(target_dir)), frozen_target_tensors(target_dir)
        )
        heads[name] = ex.save_head(head, tmp_path / name, target_identity(target_dir), {})
    with pytest.raises(ValueError, match="LlamaMTPHead for a llama target.*is deepseek_v2"):
        ex.load_head(heads["llama"], tiny_deepseek)
    with pytest.raises(ValueError, match="DeepseekV2MTPHead for a deepseek_v2 target.*is llama"):
        ex.load_head(heads["deepseek_v2"], tiny_target)
    with pytest.raises(ValueError, match="LlamaMTPHead for a llama target, this target is deepseek_v2"):
        load_draft(heads["llama"], load_target(tiny_deepseek))
    with pytest.raises(ValueError, match="DeepseekV2MTPHead for a deepseek_v2 target, this target is llama"):
        load_draft(heads["deepseek_v2"], load_target(tiny_target))


# ---------------------------------------------------------------- the MoE option (model.head_mlp=moe)


def test_moe_head_trains_its_experts_and_router(tiny_deepseek):
    """One step of the training objective (2 chained steps) on the tiny target: the loss is finite,
    every part of the MoE block gets a gradient, and the grouped matmul's backward equals a
    per-expert loop's."""
    target = load_target(tiny_deepseek)
    head = MTPHead(HeadSpec("rmsnorm-restored", target.cfg, "moe"), frozen_target_tensors(tiny_deepseek))
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (19, 12):
        ids = torch.randint(0, target.cfg.vocab_size, (n,), generator=g)
        hidden, _ = target.forward_packed(ids, cu_seqlens_of([n]))
        samples.append((ids, torch.ones(n, dtype=torch.bool), hidden))
    objective = DraftObjective(head, LossWeights(), 2**27, 0.8)
    loss, metrics = objective(collate(samples, steps=2))
    loss.backward()
    assert math.isfinite(loss.item()) and metrics["step2/count"] > 0
    mlp = head.layer.mlp
    for name, p in mlp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name

    x = torch.randn(40, target.cfg.hidden_size, requires_grad=True)
    grads = []
    for linear in (ds.grouped_linear, ds.grouped_linear_loop):
        mlp.zero_grad()
        x.grad = None
        (mlp.experts(x, *mlp.gate(x), linear=linear) * torch.linspace(-1, 1, 64)).sum().backward()
        grads.append(
            [x.grad, mlp.gate.weight.grad, mlp.experts.gate_up_proj.grad, mlp.experts.down_proj.grad]
        )
    for grouped, loop in zip(*grads):
        assert torch.allclose(grouped, loop, rtol=1e-4, atol=1e-6)


def test_moe_head_exports_to_deepseek_mtp_as_an_moe_layer(tiny_deepseek, tmp_path):
    """Native (stacked experts, `"mlp": "moe"`) → deepseek_mtp: one tensor per expert under the
    engines' names, and first_k_dense_replace left as the target has it, so vLLM and SGLang build
    layer N as MoE."""
    target = read_target_config(tiny_deepseek)
    torch.manual_seed(0)
    head = MTPHead(HeadSpec("rmsnorm-restored", target, "moe"), frozen_target_tensors(tiny_deepseek))
    ex.save_head(head, tmp_path / "head", target_identity(tiny_deepseek), {}, torch.float32)
    overrides = [
        "model=tiny_deepseek_v2",
        f"model.target={tiny_deepseek}",
        f"run_dir={tmp_path}",
        f"export.checkpoint={tmp_path / 'head'}",
        "export.formats=[native,deepseek_mtp]",
        "export.dtype=float32",
    ]
    written = export(recipe(overrides))
    assert json.loads((written["native"] / "config.json").read_text())["mlp"] == "moe"
    native = load_file(written["native"] / "head.safetensors")
    tensors = load_file(written["deepseek_mtp"] / "model.safetensors")
    config = json.loads((written["deepseek_mtp"] / "config.json").read_text())
    check_layout(tensors, deepseek_mtp_table(config, store_shared=False), "deepseek_mtp")
    assert config["first_k_dense_replace"] == target.first_k_dense_replace == 1
    assert deepseek_is_moe(config, config["num_hidden_layers"])
    p, i = "model.layers.2.mlp.", target.moe_intermediate_size
    gate_up, down = native["layer.mlp.experts.gate_up_proj"], native["layer.mlp.experts.down_proj"]
    assert gate_up.shape == (4, 2 * i, 64) and not any(".experts.gate_up_proj" in n for n in tensors)
    assert torch.equal(tensors[p + "experts.3.gate_proj.weight"], gate_up[3, :i])
    assert torch.equal(tensors[p + "experts.3.up_proj.weight"], gate_up[3, i:])
    assert torch.equal(tensors[p + "experts.1.down_proj.weight"], down[1])
    assert torch.equal(tensors[p + "gate.weight"], native["layer.mlp.gate.weight"])
    assert torch.equal(
        tensors[p + "shared_experts.up_proj.weight"], native["layer.mlp.shared_experts.up_proj.weight"]
    )


def test_moe_option_refused_on_llama_and_unknown_values(tiny_target):
    llama = read_target_config(tiny_target)
    with pytest.raises(ValueError, match="head_mlp: 'moe' .* this target is llama"):
        HeadSpec("rmsnorm-restored", llama, "moe")
    with pytest.raises(ValueError, match="head_mlp: 'sparse' is not one of"):
        HeadSpec("rmsnorm-restored", CONFIGS["lite"], "sparse")
    layer = {"format": ex.FORMAT, "format_version": ex.FORMAT_VERSION, "variant": "rmsnorm-restored"}
    with pytest.raises(ValueError, match="config.json: mlp: 'moe' .* this target is llama"):
        HeadSpec.from_config(
            {**layer, "architecture": "LlamaMTPHead", "layer_config": llama.to_hf(), "mlp": "moe"}
        )


def test_the_trainer_builds_the_configured_mlp(tiny_deepseek):
    from mtp_train.run import Target
    from mtp_train.train import build_head

    overrides = ["model=tiny_deepseek_v2", f"model.target={tiny_deepseek}", "model.head_mlp=moe"]
    cfg = recipe(overrides)
    head = build_head(cfg.model, Target.resolve(str(tiny_deepseek)), torch.float32)
    assert head.spec.mlp == "moe" and "layer.mlp.experts.gate_up_proj" in dict(head.named_parameters())
