"""The validation stage: `run_validation` (both measurements on the evaluation prompts, the report
written) and its Hydra entry point `main`, which `python -m mtp_train.validate` runs."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import torch

from inference_ref.speculative import Chain
from mtp_train.cli import RECIPES, one_line_errors
from mtp_train.config import RunConfig, checked
from mtp_train.export import load_head
from mtp_train.projection import project
from mtp_train.run import resolve_run
from mtp_train.validate.during_training import eval_prompts
from mtp_train.validate.engine import check_engine, share_identical, vllm_validation
from mtp_train.validate.parity import holdout_samples, samples_of, store_rounding, teacher_forced
from mtp_train.validate.passes import (
    Evaluator,
    drafts,
    speculative_pass,
    speculative_report,
    target_only_pass,
    temperature_name,
)
from mtp_train.validate.report import report_fingerprint, summary, verify_costs, write_report


def run_validation(cfg: RunConfig) -> dict:
    checked(cfg)
    vc = cfg.validate
    prompts = eval_prompts(vc)  # before any work: a bad or empty file fails now
    shapes = [verify_costs(path) for path in vc.verify_costs]  # before any work: a bad path fails now
    fingerprint = report_fingerprint(cfg)
    previous = Path(vc.report)
    if previous.exists() and json.loads(previous.read_text()).get("fingerprint") == fingerprint:
        print(f"validation: {previous} was made with this head and these settings; reused")
        return json.loads(previous.read_text())
    check_engine(vc, cfg.model.tp_size)
    run = resolve_run(cfg.model, vc.dtype, sharded_as="mtp_train.validate")
    ev = Evaluator.load(run, Path(vc.head), vc.compile)
    baseline, base_dialogs, base_tokens = target_only_pass(ev, prompts, vc, "validate: target alone")
    report = {
        "head": str(vc.head),
        "target": str(run.target.dir),
        "eval_files": list(vc.eval_files),
        "prompts": len(prompts),
        "turns": sum(len(p.turns) for p in prompts),
        "max_new_tokens": vc.max_new_tokens,
        "batch_size": vc.batch_size,
        "target_only": baseline,
        "verify_tokens": "tokens one verify forward of the target processes per sequence: the last "
        "committed token and the drafted ones (a chain of k: k + 1; a tree of N nodes: N + 1)",
        "speculative": {},
        "fingerprint": fingerprint,
    }
    for temperature in vc.temperatures:
        name = temperature_name(temperature)
        runs = report["speculative"][name] = {}
        for key, shape, ssd in drafts(vc, temperature):
            label = f"validate: {name}, {key}"
            stats, timing, _, tokens = speculative_pass(
                ev, prompts, shape, temperature, vc, vc.seed, label, ssd
            )
            figures = speculative_report(stats, timing, shape)
            if isinstance(shape, Chain):  # what a step's drafting costs, for `mtp_train.projection`
                figures["draft_layer_passes"] = ev.draft.layer_passes(shape.k)
                figures["block_drafter"] = not ev.draft.chains
                figures["draft_vocab_size"] = ev.draft.spec.vocab  # its lm_head's rows
            if ssd and ssd.saguaro_factor != 1.0:
                figures["saguaro"] = {"factor": ssd.saguaro_factor, "fan_out": ssd.saguaro_fan_out}
            if temperature == 0:
                figures["identical_to_target_greedy"] = tokens == base_tokens
                # in bf16 near-ties can part the texts (see validate.dtype): the share that did not
                figures["identical_answers"] = share_identical(tokens, base_tokens)
            figures["speedup_vs_target_only"] = figures["tokens_per_s"] / baseline["tokens_per_s"]
            runs[key] = figures
    head = load_head(vc.head, run.target).to(device=run.device, dtype=run.dtype)
    held = holdout_samples(cfg, ev, Path(vc.head))
    samples = held or samples_of(ev, base_dialogs, vc.teacher_forced_samples, cfg.data.max_seq_len)
    if run.main:
        print(f"validate: teacher-forced loss on {len(samples)} samples, the trainer's and inference_ref's")
    rounding = store_rounding(cfg, run.device)
    report["teacher_forced"] = teacher_forced(ev, head, samples, rounding, cfg.train.loss_chunk_logits)
    report["teacher_forced"]["text"] = "data.holdout" if held else "target answers to eval_files"
    if vc.engine == "vllm":
        del head
        ev.release()  # the engine needs the memory our target held
        report["engine"] = vllm_validation(vc, run, ev, prompts, base_tokens, report["speculative"])
    for costs in shapes:
        if "greedy" in report["speculative"]:
            report.setdefault("projected", {})[costs["shape"]] = project(report, costs)
    if run.leader:  # a tensor-parallel group's ranks hold the same report
        write_report(report, Path(vc.report))
    return report


def stage(cfg: RunConfig) -> None:
    report = run_validation(cfg)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return  # the other ranks of a tensor-parallel group: the same report, printed once
    print(summary(report))
    print(f"report: {cfg.validate.report}")


# Hydra names the app after the task function's module: `mtp_train.validate`, the package, so the job
# is `validate` as before (`hydra.job.name`: the run's ${run_dir}/hydra/validate, the help's title),
# as `mtp_train.cli.answer_help_first` names it for the help. A module's relative `config_path` is
# read inside its package, and recipes/ is in none: the repository's recipes/ by absolute path.
stage.__module__ = "mtp_train.validate"
main = hydra.main(config_path=str(RECIPES), config_name="config", version_base=None)(one_line_errors(stage))
