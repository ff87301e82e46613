"""Export: the native format round trip, target checks, atomic writes, and engine layouts' tables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import mtp_train.export as ex
from inference_ref.head_spec import HEAD_KINDS
from inference_ref.models.llama import LlamaConfig, read_config
from inference_ref.target import frozen_target_tensors
from mtp_train.config import RunConfig
from mtp_train.head_attention import Segments
from mtp_train.heads import HeadSpec, MTPHead
from mtp_train.layer_names import check_layout, deepseek_dims, llama_dims, resolve
from mtp_train.serving.layouts import (
    EAGLE1_SGLANG,
    LayoutUnsupported,
    deepseek_layer_symbolic,
    deepseek_mtp_export,
    eagle1_export,
)
from mtp_train.target_files import target_identity, write_random_target
from tiny import recipe

REPO = Path(__file__).resolve().parents[1]


def trained_head(target_dir: Path, variant: str, seed: int = 0, draft_vocab: int = 0):
    """A head of any kind on `target_dir` whose every parameter is off its initial value (norms ≠
    1, bias ≠ 0); eagle3-family heads read layers 0 and 1, a draft vocabulary the even token ids."""
    from mtp_train.heads import build

    kind = HEAD_KINDS[variant]
    aux = (0, 1) if kind.fuses_aux else ()
    block = {"block_size": 3, "mask_token_id": 0} if kind.blocks else {}
    spec = HeadSpec(variant, read_config(target_dir), aux_layers=aux, draft_vocab_size=draft_vocab, **block)
    ids = torch.arange(0, 2 * draft_vocab, 2) if draft_vocab else None
    torch.manual_seed(seed)  # before the head: its initial values are drawn too
    head = build(spec, frozen_target_tensors(target_dir), ids)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def draft_logits(head: MTPHead, steps: int = 2, n: int = 7) -> torch.Tensor:
    """Chained logits [steps, n, V] on fixed random inputs."""
    g = torch.Generator().manual_seed(1)
    cfg = head.spec.target
    hidden = torch.randn(n, cfg.hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (steps, n), generator=g)
    seg = Segments(cu_seqlens=torch.tensor([0, n]), max_len=n)
    with torch.no_grad():
        y = head(hidden, tokens, torch.arange(n), seg, steps=steps)
        return head.logits(head.output_state(y))


@pytest.fixture(scope="module")
def identity(tiny_target):
    return target_identity(tiny_target)


@pytest.fixture(scope="module")
def other_shape_target(smollm2, tmp_path_factory):
    return write_random_target(tmp_path_factory.mktemp("wide"), smollm2, seed=0, intermediate_size=96)


def run_config(target, checkpoint, out, formats, **export) -> RunConfig:
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.name, cfg.model.target = "test", str(target)
    cfg.export.checkpoint, cfg.export.out_dir, cfg.export.formats = str(checkpoint), str(out), formats
    for key, value in export.items():
        cfg.export[key] = value
    return cfg


# ------------------------------------------------------------------------------------------ native


@pytest.mark.parametrize("variant", ["rmsnorm-restored", "eagle1"])
@pytest.mark.parametrize("store_shared", [False, True])
def test_round_trip_gives_identical_logits(tiny_target, identity, tmp_path, variant, store_shared):
    head = trained_head(tiny_target, variant)
    out = ex.save_head(head, tmp_path / "head", identity, {"step": 3}, torch.float32, store_shared)
    loaded = ex.load_head(out, tiny_target)
    assert torch.equal(draft_logits(loaded), draft_logits(head))


def test_native_names_and_config_are_the_contract(tiny_target, identity, tmp_path):
    head = trained_head(tiny_target, "rmsnorm-restored")
    out = ex.save_head(head, tmp_path / "head", identity, {"step": 5, "tokens": 1000})
    tensors = load_file(out / "head.safetensors")
    layer = [
        "layer.input_layernorm.weight",
        *(f"layer.self_attn.{p}_proj.weight" for p in "qkvo"),
        "layer.post_attention_layernorm.weight",
        *(f"layer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    assert set(tensors) == {"enorm.weight", "hnorm.weight", "fc.weight", "norm.weight", *layer}
    h = head.spec.target.hidden_size
    assert tensors["fc.weight"].shape == (h, 2 * h)
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "format": "mtp-train-head",
        "format_version": 1,
        "architecture": "LlamaMTPHead",
        "variant": "rmsnorm-restored",
        "mlp": "dense",
        "dtype": "bfloat16",
        "hidden_size": h,
        "vocab_size": head.spec.target.vocab_size,
        "layer_config": head.spec.target.to_hf(),
        "shared_with_target": {"embed_tokens": True, "lm_head": True},
        "target": identity,
        "training": {"step": 5, "tokens": 1000},
    }
    assert LlamaConfig.from_hf(config["layer_config"]) == head.spec.target


def test_eagle1_native_names_and_stored_shared(tiny_target, identity, tmp_path):
    head = trained_head(tiny_target, "eagle1")
    out = ex.save_head(head, tmp_path / "head", identity, {}, store_shared=True)
    tensors = load_file(out / "head.safetensors")
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "lm_head.weight"} <= set(tensors)
    assert not any(n.startswith(("enorm", "hnorm", "norm", "layer.input_layernorm")) for n in tensors)
    assert torch.equal(tensors["embed_tokens.weight"], head.embed_weight.bfloat16())
    config = json.loads((out / "config.json").read_text())
    assert config["shared_with_target"] == {"embed_tokens": False, "lm_head": False}


def test_bf16_export(tiny_target, identity, tmp_path):
    head = trained_head(tiny_target, "rmsnorm-restored")
    out = ex.save_head(head, tmp_path / "head", identity, {})
    assert {t.dtype for t in load_file(out / "head.safetensors").values()} == {torch.bfloat16}
    loaded = ex.load_head(out, tiny_target)
    for name, p in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p.bfloat16().float()), name


def test_params_override_the_module_state(tiny_target, identity, tmp_path):
    # What the trainer passes under ZeRO-3, where the module's own parameters are shards.
    head = trained_head(tiny_target, "eagle1")
    params = {n: torch.full_like(t, 0.5) for n, t in head.state_dict().items()}
    out = ex.save_head(head, tmp_path / "head", identity, {}, torch.float32, params=params)
    assert all((t == 0.5).all() for t in load_file(out / "head.safetensors").values())
    with pytest.raises(ValueError, match="params names"):
        ex.save_head(head, tmp_path / "bad", identity, {}, params={"fc.weight": params["fc.weight"]})


# ----------------------------------------------------------------------------------- target checks


def test_load_refuses_another_target(tiny_target, identity, other_shape_target, smollm2, tmp_path):
    out = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "head", identity, {})
    with pytest.raises(ValueError, match=r"trained for .*tiny_target.*config_hash.*wide"):
        ex.load_head(out, other_shape_target)
    narrow = write_random_target(tmp_path / "narrow", smollm2, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="has hidden_size 64, this target has 32"):
        ex.load_head(out, narrow)


def test_load_refuses_another_vocabulary_not_another_tokenizer_file(tiny_target, identity, tmp_path):
    """A head's ids mean the tokenizer's tokens: another vocabulary is refused, while another
    tokenizer.json with the same token ↔ id map (two transformers versions write two files for one
    GGUF's tokenizer) is the same target."""
    out = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "head", identity, {})
    twin = tmp_path / "twin"
    shutil.copytree(tiny_target, twin)
    with open(twin / "tokenizer.json", "a") as f:
        f.write("\n")  # same tokens, another file
    ex.load_head(out, twin)
    other = tmp_path / "other"
    shutil.copytree(tiny_target, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[a], vocab[b] = 301, 300  # two tokens swap ids: each id now means the other text
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="vocab_hash"):
        ex.load_head(out, other)


def test_export_refuses_another_target(tiny_target, identity, other_shape_target, tmp_path):
    ckpt = ex.save_head(trained_head(tiny_target, "rmsnorm-restored"), tmp_path / "head", identity, {})
    cfg = run_config(other_shape_target, ckpt, tmp_path / "export", ["native"])
    with pytest.raises(ValueError, match="another target"):
        ex.export(cfg)
    assert not (tmp_path / "export").exists()


# ---------------------------------------------------------------------------------------- atomicity


def test_failed_write_leaves_no_partial_head(tiny_target, identity, tmp_path, monkeypatch):
    head = trained_head(tiny_target, "rmsnorm-restored")
    out = tmp_path / "head"

    def dies_midway(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ex, "save_file", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        ex.save_head(head, out, identity, {})
    assert os.listdir(tmp_path) == []

    monkeypatch.undo()
    ex.save_head(head, out, identity, {"step": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(ex, "save_file", dies_midway)
    with pytest.raises(OSError):
        ex.save_head(trained_head(tiny_target, "rmsnorm-restored", seed=1), out, identity, {"step": 2})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["head"]


def test_replaces_a_head_and_clears_stale_temporaries(tiny_target, identity, tmp_path):
    out = tmp_path / "head"
    (tmp_path / ".head.tmp-deadbeef").mkdir()  # left by a killed export
    ex.save_head(trained_head(tiny_target, "eagle1"), out, identity, {"step": 1})
    ex.save_head(trained_head(tiny_target, "eagle1"), out, identity, {"step": 2})
    assert os.listdir(tmp_path) == ["head"]
    assert json.loads((out / "config.json").read_text())["training"] == {"step": 2}


def test_exported_files_are_as_readable_as_the_umask_allows(tiny_target, identity, tmp_path):
    """safetensors writes 0600; a serving engine running as another user must read the head."""
    old = os.umask(0o022)
    try:
        out = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "head", identity, {})
    finally:
        os.umask(old)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        "head.safetensors": 0o644,
        "config.json": 0o644,
    }


def test_refuses_to_replace_a_foreign_directory(tiny_target, identity, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path, identity, {})
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------- engine layouts


def test_eagle1_layout_matches_sglang_table(tiny_target, identity, tmp_path):
    head = trained_head(tiny_target, "eagle1")
    ckpt = ex.save_head(head, tmp_path / "head", identity, {"step": 9}, torch.float32)
    written = ex.export(
        run_config(tiny_target, ckpt, tmp_path / "export", ["native", "eagle1"], dtype="float32")
    )
    tensors = load_file(written["eagle1"] / "model.safetensors")
    cfg = head.spec.target
    check_layout(tensors, resolve(EAGLE1_SGLANG, llama_dims(cfg)), "eagle1")
    block = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "post_attention_layernorm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    assert set(tensors) == {"fc.weight", "fc.bias", *(f"layers.0.{n}" for n in block)}
    own = head.state_dict()
    assert torch.equal(tensors["fc.bias"], own["fc.bias"])
    assert all(torch.equal(tensors[f"layers.0.{n}"], own[f"layer.{n}"]) for n in block)
    config = json.loads((written["eagle1"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    assert LlamaConfig.from_hf(config).hidden_size == cfg.hidden_size
    # The native re-export is the same head.
    assert torch.equal(draft_logits(ex.load_head(written["native"], tiny_target)), draft_logits(head))


def test_restored_llama_head_has_no_engine_layout(tiny_target, identity, tmp_path):
    head = trained_head(tiny_target, "rmsnorm-restored")
    ckpt = ex.save_head(head, tmp_path / "head", identity, {})
    for layout, reason in (("eagle1", "input_layernorm"), ("deepseek_mtp", "DeepseekV2DecoderLayer")):
        with pytest.raises(LayoutUnsupported, match=reason):
            ex.export(run_config(tiny_target, ckpt, tmp_path / "export", ["native", layout]))
        assert not (tmp_path / "export").exists()  # native was not written either
    with pytest.raises(ValueError, match="unknown layout"):
        ex.export(run_config(tiny_target, ckpt, tmp_path / "export", ["medusa"]))


def test_eagle1_layout_refuses_a_non_llama_target():
    with pytest.raises(LayoutUnsupported, match="Llama"):
        eagle1_export({}, {"model_type": "deepseek_v2"}, "eagle1")


# A DeepSeek-V2-Lite-shaped config, shrunk: 3 layers, MLA without q LoRA, MoE from layer 1.
DEEPSEEK = dict(
    model_type="deepseek_v2",
    architectures=["DeepseekV2ForCausalLM"],
    vocab_size=50,
    hidden_size=16,
    intermediate_size=40,
    moe_intermediate_size=8,
    n_routed_experts=4,
    n_shared_experts=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    num_hidden_layers=3,
    num_attention_heads=2,
    q_lora_rank=None,
    kv_lora_rank=6,
    qk_nope_head_dim=4,
    qk_rope_head_dim=2,
    v_head_dim=4,
    rms_norm_eps=1e-6,
)


def synthetic_deepseek_head(hf: dict, store_shared: bool = False) -> dict[str, torch.Tensor]:
    """A DeepSeek-kind rmsnorm-restored head's state dict with the block of the target's layer N
    (MoE unless the config makes it dense): `layer.` + DeepSeek names."""
    h, v = hf["hidden_size"], hf["vocab_size"]
    block = resolve(deepseek_layer_symbolic(hf, hf["num_hidden_layers"]), deepseek_dims(hf))
    sd = {f"layer.{n}": torch.randn(s) for n, s in block.items()}
    sd.update({"enorm.weight": torch.randn(h), "hnorm.weight": torch.randn(h), "norm.weight": torch.randn(h)})
    sd["fc.weight"] = torch.randn(h, 2 * h)
    if store_shared:
        sd.update({"embed_tokens.weight": torch.randn(v, h), "lm_head.weight": torch.randn(v, h)})
    return sd


def test_deepseek_mtp_table_on_synthetic_v2_state_dict():
    head = synthetic_deepseek_head(DEEPSEEK)
    layout = deepseek_mtp_export(head, DEEPSEEK, "rmsnorm-restored")
    check_layout(layout.tensors, layout.table, "deepseek_mtp")
    p = "model.layers.3."  # N = num_hidden_layers: the layer after the target's last
    shapes = {n.removeprefix(p): tuple(t.shape) for n, t in layout.tensors.items()}
    assert all(n.startswith(p) for n in layout.tensors)
    assert len(shapes) == 4 + 7 + 4 + 4 * 3  # own, attention + norms, gate + shared experts, experts
    assert shapes["enorm.weight"] == shapes["hnorm.weight"] == shapes["shared_head.norm.weight"] == (16,)
    assert shapes["eh_proj.weight"] == (16, 32)
    assert shapes["self_attn.q_proj.weight"] == (2 * 6, 16)
    assert shapes["self_attn.kv_a_proj_with_mqa.weight"] == (6 + 2, 16)
    assert shapes["self_attn.kv_a_layernorm.weight"] == (6,)
    assert shapes["self_attn.kv_b_proj.weight"] == (2 * (4 + 4), 6)
    assert shapes["self_attn.o_proj.weight"] == (16, 2 * 4)
    assert shapes["mlp.gate.weight"] == (4, 16)
    assert shapes["mlp.shared_experts.gate_proj.weight"] == (8 * 2, 16)
    assert shapes["mlp.experts.3.down_proj.weight"] == (16, 8)
    assert torch.equal(layout.tensors[p + "eh_proj.weight"], head["fc.weight"])
    assert torch.equal(layout.tensors[p + "shared_head.norm.weight"], head["norm.weight"])
    assert layout.config["num_nextn_predict_layers"] == 1 and layout.config["num_hidden_layers"] == 3
    assert layout.config["architectures"] == ["DeepseekV3ForCausalLM"]


def test_deepseek_mtp_table_v3_routing_q_lora_and_shared_tensors():
    hf = {**DEEPSEEK, "q_lora_rank": 5, "topk_method": "noaux_tc"}
    layout = deepseek_mtp_export(synthetic_deepseek_head(hf, store_shared=True), hf, "rmsnorm-restored")
    check_layout(layout.tensors, layout.table, "deepseek_mtp")
    shapes = {n.removeprefix("model.layers.3."): tuple(t.shape) for n, t in layout.tensors.items()}
    assert shapes["self_attn.q_a_proj.weight"] == (5, 16) and shapes["self_attn.q_b_proj.weight"] == (12, 5)
    assert shapes["mlp.gate.e_score_correction_bias"] == (4,)
    assert shapes["embed_tokens.weight"] == shapes["shared_head.head.weight"] == (50, 16)
    assert "self_attn.q_proj.weight" not in shapes


def test_deepseek_mtp_table_dense_layer_and_mismatch_reported():
    hf = {**DEEPSEEK, "first_k_dense_replace": 10}
    head = synthetic_deepseek_head(hf)
    layout = deepseek_mtp_export(head, hf, "rmsnorm-restored")
    assert layout.table["model.layers.3.mlp.gate_proj.weight"] == (40, 16)
    assert not any("experts" in n for n in layout.table)
    del head["layer.self_attn.kv_b_proj.weight"]
    head["fc.weight"] = torch.randn(16, 16)
    broken = deepseek_mtp_export(head, hf, "rmsnorm-restored")
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.self_attn.kv_b_proj.weight'\]"):
        check_layout(broken.tensors, broken.table, "deepseek_mtp")
    with pytest.raises(LayoutUnsupported, match="eagle1"):
        deepseek_mtp_export(head, hf, "eagle1")


# --------------------------------------------------------------------------------------------- CLI


def cli_args(target, ckpt, tmp_path) -> list[str]:
    return [
        "model=tiny_random",
        f"model.target={target}",
        f"run_dir={tmp_path / 'run'}",
        f"export.checkpoint={ckpt}",
        f"export.out_dir={tmp_path / 'export'}",
        "export.formats=[native,eagle1]",
    ]


def test_recipe_composes_into_an_export(tiny_target, identity, tmp_path):
    # The command line's config, composed in-process (the subprocess run below is marked slow).
    ckpt = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "head", identity, {})
    cfg = recipe(cli_args(tiny_target, ckpt, tmp_path))
    written = ex.export(cfg)
    assert set(written) == {"native", "eagle1"}
    assert (tmp_path / "export" / "eagle1" / "model.safetensors").exists()


@pytest.mark.slow
def test_cli_writes_requested_layouts(tiny_target, identity, tmp_path):
    ckpt = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "head", identity, {})
    cmd = [sys.executable, "-m", "mtp_train.export", *cli_args(tiny_target, ckpt, tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "export" / "native" / "head.safetensors").exists()
    assert (tmp_path / "export" / "eagle1" / "model.safetensors").exists()


# ---------------------------------------------------------------------------- engine exports read back


@pytest.mark.parametrize(
    ("variant", "layout", "draft_vocab"),
    [
        ("eagle3", "vllm", 0),
        ("eagle3", "eagle3", 64),
        ("eagle3.1", "vllm", 64),
        ("eagle3.1", "vllm", 0),
        ("rmsnorm-restored", "vllm", 0),  # the plugin's layout
        ("rmsnorm-restored", "vllm", 64),
        ("eagle1", "vllm", 0),
        ("eagle1", "vllm", 64),
        ("dflash", "vllm", 0),  # vLLM's DFlashDraftModel
        ("dflash", "vllm", 64),
    ],
)
def test_an_engine_export_reads_back_as_its_native_head(
    tiny_target, identity, tmp_path, variant, layout, draft_vocab
):
    """A head's eagle3 / vllm export is a head directory in its own right: the training
    module and the serving draft read it back to the native head's tensors (the whole vocabulary's
    vllm export holds no lm_head: vLLM shares the target's)."""
    from inference_ref.draft import load_draft
    from inference_ref.target import load_target

    native = ex.save_head(
        trained_head(tiny_target, variant, draft_vocab=draft_vocab), tmp_path / "native", identity, {}
    )
    out = ex.export_layouts(native, tiny_target, [layout], tmp_path / "export", dtype="float32")[layout]
    written = load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in written) == (layout == "eagle3" or draft_vocab > 0)
    a, b = ex.load_head(native, tiny_target).state_dict(), ex.load_head(out, tiny_target).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert any(n.startswith("fc_norm.") for n in a) == (variant == "eagle3.1")
    target = load_target(tiny_target, "cpu", torch.float32)
    drafts = [load_draft(d, target) for d in (native, out)]
    x, y = (d.state_dict() for d in drafts)
    assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
    assert ex.read_head_config(out)["variant"] == variant  # export.checkpoint= takes it too


def test_an_engine_export_without_the_native_config_is_refused_in_one_line(tiny_target, identity, tmp_path):
    """Another tool's export (or one from before dflash exports carried it) names the fix."""
    native = ex.save_head(trained_head(tiny_target, "dflash"), tmp_path / "native", identity, {})
    out = ex.export_layouts(native, tiny_target, ["vllm"], tmp_path / "export")["vllm"]
    config = json.loads((out / "config.json").read_text())
    del config["mtp_train_head"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DFlashDraftModel.*carries no native config.*native export"):
        ex.load_head(out, tiny_target)


def test_a_head_directory_that_is_missing_or_holds_no_config_is_named(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope: no such directory \(expected a head directory"):
        ex.load_head(tmp_path / "nope", tiny_target)
    with pytest.raises(FileNotFoundError, match=r": no config.json \(expected a head directory"):
        ex.load_head(tmp_path, tiny_target)


def test_a_bad_weights_file_is_named_as_the_file_read(tiny_target, identity, tmp_path):
    """An engine export's checks name its model.safetensors, not a native head.safetensors that
    is not there; a corrupt file is named too (safetensors' own error names none)."""
    native = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "native", identity, {})
    out = ex.export_layouts(native, tiny_target, ["vllm"], tmp_path / "export")["vllm"]
    config = json.loads((out / "config.json").read_text())
    config["mtp_train_head"]["variant"] = "rmsnorm-restored"  # tensors of another kind
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=rf"^{out / 'model.safetensors'} \(read under native names\): missing"
    ):
        ex.load_head(out, tiny_target)
    (native / "head.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=rf"^{native / 'head.safetensors'}: not a readable safetensors file"):
        ex.load_head(native, tiny_target)


def test_a_head_config_lacking_fields_or_not_an_object_is_refused_in_one_line(
    tiny_target, identity, tmp_path
):
    from mtp_train.serving.vllm_engine import head_method

    native = ex.save_head(trained_head(tiny_target, "eagle1"), tmp_path / "native", identity, {})
    out = ex.export_layouts(native, tiny_target, ["vllm"], tmp_path / "export")["vllm"]
    config = json.loads((out / "config.json").read_text())
    del config["mtp_train_head"]["target"], config["mtp_train"]["variant"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json \(the head's native config\): missing target$"):
        ex.load_head(out, tiny_target)
    with pytest.raises(ValueError, match=r"config.json: mtp_train: missing variant$"):
        head_method(out)
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: a list, not a JSON object$"):
        ex.load_head(out, tiny_target)


def test_records_without_a_vocab_hash_are_compared_by_the_tokenizer_file(identity):
    from mtp_train.target_files import check_same_target

    old = {k: v for k, v in identity.items() if k != "vocab_hash"}
    check_same_target(identity, old, "an old store")
    with pytest.raises(ValueError, match="tokenizer_hash"):
        check_same_target(identity, {**old, "tokenizer_hash": "0" * 16}, "an old store")
    check_same_target(
        identity, {**identity, "tokenizer_hash": "0" * 16}, "a new store"
    )  # the vocabulary decides
