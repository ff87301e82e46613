"""The trainer's periodic validation (`DuringTraining`): teacher-forced parity and greedy
speculative decoding of chains on the head the trainer has just exported, as sums over this
process's prompts (`ValidationSums`, `PathSums`) that the trainer adds across processes. No report
or plotting code: the trainer imports this module alone."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from pathlib import Path

from inference_ref.draft import load_draft
from inference_ref.speculative import Chain, SpecStats
from mtp_train.config import ConfigError, RunConfig, ValidateConfig
from mtp_train.data import Prompt, Sample, named_prompts
from mtp_train.export import load_head
from mtp_train.run import Run
from mtp_train.validate.parity import holdout_samples, samples_of, store_rounding, teacher_forced
from mtp_train.validate.passes import Evaluator, speculative_pass, target_only_pass


def eval_prompts(vc: ValidateConfig) -> list[Prompt]:
    """validate.eval_files' prompts (at most validate.num_prompts), refused in one line when it
    names no file or its files hold none: validation and the trainer call it before loading the
    target or taking a step."""
    if not vc.eval_files:
        raise ConfigError(
            "validate.eval_files is empty: name the evaluation prompts (e.g. data/mt_bench.jsonl)"
        )
    return named_prompts("validate.eval_files", vc.eval_files, vc.num_prompts)


class DuringTraining:
    """The trainer's periodic validation: the teacher-forced part every `validate_every` steps and
    the greedy speculative loop at the `spec_validate_at` steps, through inference_ref on the head
    the trainer has just exported. The target and the target's own answers to the evaluation
    prompts (the teacher-forced text) are computed once and kept.

    In a job of N processes each validates every N-th prompt and returns sums, which the trainer
    adds across processes (`figures` turns them into rates): no process waits while another
    validates, and the work is split N ways. Each process loads the target for this."""

    def __init__(self, cfg: RunConfig, run: Run, rank: int = 0, world: int = 1):
        if cfg.model.tp_size > 1:
            raise ConfigError(
                f"train.validate_every / train.spec_validate_at load the whole target on every training "
                f"process, and model.tp_size={cfg.model.tp_size} says it does not fit one GPU: validate "
                "after training (mtp_train.validate, launched as one tensor-parallel group)"
            )
        self.cfg, self.run, self.rank, self.world = cfg, run, rank, world
        self.ev: Evaluator | None = None
        vc = cfg.validate
        self.prompts = eval_prompts(vc)[rank::world]
        # Prompt m of this rank is prompt rank + m·world overall: the teacher-forced set is the
        # first `teacher_forced_samples` prompts whatever the number of processes.
        self.tf_limit = max(0, -(-(vc.teacher_forced_samples - rank) // world))
        self.samples: list[Sample] = []

    def __call__(self, head_dir: Path, spec: bool) -> ValidationSums:
        """Sums over this process's prompts (the same shape on every process)."""
        chains = self.cfg.validate.chain_lengths if spec else []
        sums = ValidationSums.empty(chains)
        if self.prompts:
            self._load(head_dir)
            sums.trainer, sums.inference = self._teacher_forced_sums(head_dir)
            for k in chains:
                sums.chains[k] = self._speculative_sums(k)
        return sums

    def _load(self, head_dir: Path) -> None:
        vc = self.cfg.validate
        if self.ev is None:
            say = print if self.rank == 0 else None  # the first validation loads the target
            self.ev = Evaluator.load(self.run, head_dir, vc.compile, say)
            label = "validation: the target's answers (once)" if self.rank == 0 else None
            _, dialogs, _ = target_only_pass(self.ev, self.prompts, vc, label)
            held = holdout_samples(self.cfg, self.ev, head_dir)[self.rank :: self.world]
            self.samples = held or samples_of(self.ev, dialogs, self.tf_limit, self.cfg.data.max_seq_len)
        else:
            self.ev.draft = load_draft(head_dir, self.ev.target)

    def _teacher_forced_sums(self, head_dir: Path) -> tuple[PathSums, PathSums]:
        head = load_head(head_dir, self.run.target).to(device=self.run.device, dtype=self.run.dtype)
        rounding = store_rounding(self.cfg, self.run.device)
        tf = teacher_forced(self.ev, head, self.samples, rounding, self.cfg.train.loss_chunk_logits)
        return PathSums.of(tf["trainer"]), PathSums.of(tf["inference"])

    def _speculative_sums(self, k: int) -> SpecStats:
        vc = self.cfg.validate
        return speculative_pass(self.ev, self.prompts, Chain(k), 0.0, vc, vc.seed)[0]


@dataclass
class PathSums:
    """Teacher-forced sums of one code path: CE and top-1 summed over positions, and the positions."""

    ce: float = 0.0
    top1: float = 0.0
    positions: float = 0.0

    @classmethod
    def of(cls, means: dict) -> PathSums:
        n = means["positions"]
        return cls(means["ce"] * n, means["top1"] * n, n)


@dataclass
class ValidationSums:
    """One process's validation sums. Processes add theirs elementwise (`flat` / `from_flat`),
    then `figures` turns the totals into rates."""

    trainer: PathSums
    inference: PathSums
    chains: dict[int, SpecStats]
    """Greedy speculative decoding with k drafts: its counts (verify steps, tokens emitted, drafts
    tried and accepted per position) are what is added."""

    @classmethod
    def empty(cls, chains: list[int]) -> ValidationSums:
        """Zeros of the full shape: a process without prompts still takes part in the reduce."""
        return cls(PathSums(), PathSums(), {k: SpecStats(k) for k in chains})

    def flat(self) -> list[float]:
        values = [*astuple(self.trainer), *astuple(self.inference)]
        for c in self.chains.values():
            values += [c.steps, c.emitted, *c.tried, *c.accepted]
        return values

    def from_flat(self, values: list[float]) -> ValidationSums:
        """Sums of this shape holding `values` (as `flat` lays them out)."""
        it = iter(values)

        def take(n: int) -> list[float]:
            return [next(it) for _ in range(n)]

        per_path = len(fields(PathSums))
        trainer, inference = PathSums(*take(per_path)), PathSums(*take(per_path))
        chains = {k: SpecStats(k) for k in self.chains}
        for k, c in chains.items():
            c.steps, c.emitted = take(2)
            c.tried, c.accepted = take(k), take(k)
        return ValidationSums(trainer, inference, chains)

    def figures(self) -> dict[str, float]:
        """The logged figures: teacher-forced loss, top-1 and the two paths' gap; τ and per-position
        acceptance for each chain length."""

        def rate(a: float, b: float) -> float:
            return a / b if b else float("nan")

        t, i = self.trainer, self.inference
        out = {
            "val/loss": rate(i.ce, i.positions),
            "val/top1": rate(i.top1, i.positions),
            "val/parity_gap": abs(rate(t.ce, t.positions) - rate(i.ce, i.positions)),
        }
        for k, c in self.chains.items():
            out[f"val/tau_k{k}"] = c.mean_accepted_len
            for j, accepted in enumerate(c.accept_rate):
                out[f"val/accept_k{k}_pos{j + 1}"] = accepted
        return out
