"""Validate a head through the serving implementations: `python -m mtp_train.validate`.

Two measurements, both on the evaluation prompts (MT-bench by default, every turn answered in order):

- speculative decoding with inference_ref's target and draft, for each chain length k, each draft
  tree budget (EAGLE-2 dynamic trees of `validate.tree_depth`, N nodes: `validate.tree_budgets`) and
  temperature: per-position (per-depth) acceptance, mean accepted length τ, the tokens each verify
  forward processes (k + 1 or N + 1: chains and trees side by side at equal verify budgets), the
  draft/target time split, and (greedy) whether the output equals target-only greedy output;
- the teacher-forced loss and top-1 on the target's own answers, computed twice: by the training
  module on states from the precompute path (rounded on CUDA as the training store holds them, bf16
  or fp8 by its manifest; fp32 on CPU, see `store_rounding`), and by the inference draft on states from the target's
  KV-cache path. Their difference is `parity_gap`.

The package: `passes` (the decoding passes), `parity` (the teacher-forced loss, twice),
`during_training` (the trainer's periodic validation), `report` (the JSON, the plots, the summary in
words) and `entry` (`run_validation` and the Hydra entry point). Importing the package imports none
of them: each name below loads its module when first asked for (so `--help` is answered before
torch is imported, and the trainer's `during_training` comes without the report and plotting code).
"""

from __future__ import annotations

import importlib

_MODULE_OF = {
    **dict.fromkeys(
        (
            "Evaluator",
            "merge",
            "answer_turns",
            "timed_pass",
            "speculative_pass",
            "by_category",
            "speculative_report",
            "target_only_pass",
            "drafts",
        ),
        "passes",
    ),
    **dict.fromkeys(
        (
            "trainer_path",
            "inference_path",
            "teacher_forced",
            "store_rounding",
            "round_as_stored",
            "samples_of",
            "holdout_samples",
        ),
        "parity",
    ),
    **dict.fromkeys(("DuringTraining", "PathSums", "ValidationSums"), "during_training"),
    **dict.fromkeys(
        (
            "report_fingerprint",
            "verify_costs",
            "write_report",
            "plot_acceptance",
            "plot_projection",
            "plot_budgets",
            "draft_words",
            "equal_budgets",
            "summary",
        ),
        "report",
    ),
    **dict.fromkeys(("run_validation", "main"), "entry"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
