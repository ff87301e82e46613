"""The whole pipeline on SmolLM2-135M-Instruct on a CPU, in minutes: `python -m mtp_train.demo`.

regenerate (the target answers shared prompts) → precompute → train → validate (real speculative
decoding on MT-bench) → export, then a short summary. Each stage is the same function its own
entry point runs; extra arguments are Hydra overrides (e.g. `train.steps=100`).
"""

from __future__ import annotations

import json
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train.cli import compose_recipe

REPO = Path(__file__).resolve().parent.parent

# Sized for a 2-core laptop: a few hundred self-distilled answers, a few minutes of training.
DEMO = [
    "model=smollm2_135m",
    "run_dir=outputs/demo",
    f"regenerate.prompts=[{REPO}/data/demo_prompts.jsonl]",
    "regenerate.limit=480",
    "regenerate.max_new_tokens=80",
    "regenerate.max_prompt_tokens=160",
    "regenerate.batch_size=60",
    # The store is written from the states the target computes while answering: precompute finds
    # it complete instead of running the target over the answers again.
    "regenerate.capture=true",
    "data.train_files=[${regenerate.output}]",
    # The head scores the 4,096 most frequent tokens of its training answers, not all 49,152: the
    # vocabulary work was 78 % of a training step on a 2-core CPU (τ unchanged, docs/design.md).
    "model.draft_vocab_size=4096",
    "data.max_seq_len=320",
    "precompute.tokens_per_batch=4096",
    # Two chained steps: the head learns to draft from its own state, which is what positions
    # 2 … k of a chain see (single-step training leaves them at about half the first's acceptance).
    "train.unroll_steps=2",
    "train.steps=160",
    "train.tokens_per_micro_batch=2048",
    "train.warmup_steps=20",
    "train.lr=2e-3",
    "train.save_every=80",
    "logging.log_every=10",
    f"validate.eval_files=[{REPO}/data/mt_bench.jsonl]",
    "validate.num_prompts=12",
    "validate.max_new_tokens=64",
    "validate.chain_lengths=[3]",
    "validate.temperatures=[0.0]",
    "validate.batch_size=12",
    "validate.teacher_forced_samples=8",
    "validate.dtype=float32",  # greedy speculative output checked token-identical to the target's
    "export.formats=[native]",
]


# With vLLM installed (scripts/setup.sh installs its CPU build), validation also serves the head in
# vLLM, greedy, on the same prompts: vLLM's τ and counts beside ours (they must be equal in fp32),
# and the head is exported in the `vllm` layout that `python -m mtp_train.serve` hands to vLLM.
# What it costs (~70 s on 2 cores: the vLLM process, an engine start, its decoding) was made room
# for: validation samples no longer (validate.temperatures=[0.0,1.0] adds it back), vLLM's speculative
# answers are compared with inference_ref's target alone rather than a second vLLM engine's, and
# the target answers 480 prompts, not 520.
WITH_VLLM = [
    "validate.engine=vllm",
    "validate.engine_target_alone=false",
    "export.formats=[native,vllm]",
]


def demo_settings() -> list[str]:
    return DEMO + (WITH_VLLM if find_spec("vllm") is not None else [])


def demo_config(overrides: list[str]):
    cfg = compose_recipe(demo_settings() + list(overrides))
    OmegaConf.resolve(cfg)  # stages receive sub-configs; resolve cross-references once, here
    return cfg


def demo_help() -> str:
    """`python -m mtp_train.demo --help`: what it runs and the settings it adds to the recipes."""
    settings = "\n".join(f"  {o}" for o in demo_settings())
    return (
        f"{__doc__.strip()}\n\nusage: python -m mtp_train.demo [OVERRIDE ...]\n\n"
        f"The demo's settings, on top of recipes/config.yaml (an override replaces one):\n{settings}\n\n"
        "Every field and its default: python -m mtp_train.train --help"
    )


def describe_regeneration(counts: dict) -> str:
    return (
        f"{counts['written']} conversations answered now, {counts['already_done']} earlier; "
        f"{counts['new_tokens']:,} new tokens; {counts['unfinished']} answers stopped at "
        f"regenerate.max_new_tokens before the end; {counts['skipped']} prompts skipped as longer than "
        "regenerate.max_prompt_tokens"
    )


def stage(name: str):
    print(f"\n=== {name} ===", flush=True)
    return time.perf_counter()


def run_demo(overrides: list[str]) -> dict:
    """Run every stage; returns the validation report with the stages' figures added."""
    print("importing torch, transformers and the stages (about 15 s on 2 cores)", flush=True)
    import torch

    from mtp_train.capture import StoreCapture
    from mtp_train.export import export
    from mtp_train.precompute import run_precompute
    from mtp_train.regenerate import regenerate
    from mtp_train.run import resolve_run
    from mtp_train.store import Store
    from mtp_train.train import train
    from mtp_train.validate import run_validation, summary

    cfg = demo_config(overrides)
    started = time.perf_counter()
    t = stage("target")
    run = resolve_run(cfg.model)
    print(f"{run.target.dir} ({time.perf_counter() - t:.0f} s)")
    t = stage("regenerate: the target answers the prompts (their states go to the store)")
    capture = StoreCapture(cfg, run.target, run.dtype) if cfg.regenerate.capture else None
    counts = regenerate(
        cfg.regenerate, run.target.dir, run.device, run.dtype, run.quantization, capture=capture
    )
    print(describe_regeneration(counts) + f" ({time.perf_counter() - t:.0f} s)")
    t = stage("precompute: hidden states to the store")
    store = Store(run_precompute(cfg))
    print(f"{len(store)} samples, {int(store.lengths.sum())} tokens ({time.perf_counter() - t:.0f} s)")
    t = stage("train")
    head_dir = train(cfg)
    print(f"head: {head_dir} ({time.perf_counter() - t:.0f} s)")
    engines = "inference_ref and vLLM" if cfg.validate.engine == "vllm" else "inference_ref"
    t = stage(f"validate: speculative decoding on MT-bench through {engines}")
    report = run_validation(cfg)
    print(f"({time.perf_counter() - t:.0f} s)")
    t = stage("export")
    exported = export(cfg)
    print(
        ", ".join(f"{name}: {path}" for name, path in exported.items())
        + f" ({time.perf_counter() - t:.0f} s)"
    )
    print("\n=== summary ===")
    print(f"store: {cfg.precompute.store_dir}  ({len(store)} samples, {int(store.lengths.sum())} tokens)")
    trained = json.loads((Path(cfg.train.out_dir) / "train_summary.json").read_text())
    print(
        f"train: {trained['steps']} steps, {trained['tokens']:,} tokens, last loss {trained['loss']:.3f}, "
        f"top-1 {trained['top1']:.3f} (step 1 of the chain), {trained['seconds']:.0f} s"
    )
    print(summary(report))
    print(f"head: {head_dir}\nexport: {', '.join(str(path) for path in exported.values())}")
    if "vllm" in exported:
        print(
            f"serve it in vLLM: python -m mtp_train.serve run_dir={cfg.run_dir}  (prints the vllm serve command)"
        )
    print(f"report: {cfg.validate.report}")
    print(published_heads())
    print(f"total {time.perf_counter() - started:.0f} s on {torch.get_num_threads()} threads")
    return report


PUBLISHED = Path(__file__).resolve().parent.parent / "heads" / "smollm2_135m"


def published_heads() -> str:
    """Where the heads trained longer on a GPU are, and the command that tries one (where the
    checkout has them: an installed wheel has no `heads/`)."""
    card = PUBLISHED / "card.json"
    if not card.exists():
        return "published heads: heads/smollm2_135m in the repository"
    heads = json.loads(card.read_text())["heads"]
    name, head = next(iter(heads.items()))
    return (
        f"published heads, trained longer on a GPU ({', '.join(heads)}; τ and recipe in "
        f"{PUBLISHED / 'README.md'}): try one with\n  python -m mtp_train.validate "
        f"model.variant={head['variant']} validate.head={PUBLISHED / head['dir']} "
        f"validate.eval_files=[{PUBLISHED.parent.parent / 'data' / 'mt_bench.jsonl'}] validate.num_prompts=6 validate.chain_lengths=[4] "
        "validate.temperatures=[0.0]"
    )


if __name__ == "__main__":
    from mtp_train.cli import help_asked, one_line_errors

    if help_asked():
        print(demo_help())
        sys.exit(0)
    one_line_errors(run_demo)(sys.argv[1:])
