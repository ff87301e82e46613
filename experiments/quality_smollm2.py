"""The quality experiment on SmolLM2-135M-Instruct (one GPU or a few): EAGLE's head vs the
rmsnorm-restored head vs the restored head trained on three chained steps, each with its own
learning-rate sweep.

    python -m experiments.quality_smollm2 run TARGET CHAT_PROMPTS.jsonl GSM8K.jsonl RUN_DIR \
        [plan.FIELD=V ...] [HYDRA=V ...]
    python -m experiments.quality_smollm2 report RUN_DIR docs/results
    python -m experiments.quality_smollm2 split-prompts CHAT_PROMPTS.jsonl RUN_DIR
    python -m experiments.quality_smollm2 selection RUN_DIR
    python -m experiments.quality_smollm2 convert-gguf MODEL.gguf OUT_DIR

`plan.FIELD=V` changes the experiment's `Plan` (e.g. `plan.steps=20 plan.lrs=1e-3,2e-3` for a
rehearsal); any other `key=value` is a Hydra override passed to every stage.

`run` goes end to end, every stage through the project's own entry points (the exact commands are
written to RUN_DIR/commands.sh) and skipped when its output exists, so a killed run is restarted by
running it again:

1. a seeded sample of the chat prompts is set aside for choosing learning rates (never trained on);
2. the target answers every other prompt (regenerate, one share of the prompts per GPU), and
   precompute stores the hidden states;
3. every (head, lr) pair trains on the same store, with the same steps, tokens and schedule, several
   runs at a time on each GPU (a 3M-parameter head leaves one mostly idle); each ends with greedy
   speculative decoding (k = 4) on the set-aside prompts;
4. per head, the learning rate with the highest mean accepted length there is kept, and that head is
   validated on MT-bench (both turns) and vicuna-bench for k = 1…5, greedy and T = 1.

`report` turns RUN_DIR into the tables and PNG training curves the run's write-up quotes
(docs/results/<run>/README.md). The last three are the steps `quality_push.sh` and `gpu_machine.sh`
take on their own: the seeded set-aside prompts (step 1 above), each trained head's last validation
on them (`selection.json`), and the GGUF target converted once.

Expected on one H200 (from the measured parts): regenerate ≈ 200 s (34k prompts, 5.4M new
tokens), precompute ≈ 20 s (9.2M tokens), the sweep ≈ 10–12 min (nine 600-step runs of 32k-token
micro-batches sharing the GPU; one run alone trains at 408k tokens/s, 133k with unroll 3),
validation ≈ 3 min; two GPUs take about half as long. Every stage resumes, so a run cut short by a
time limit continues where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments import long_inputs
from experiments.quality_heads import BENCHES, HEADS, REPO, Head

LONG_INPUTS = REPO / "data/long_inputs.jsonl"


@dataclass(frozen=True)
class Plan:
    """What every head gets alike. One epoch of the regenerated set is ≈ 9M stored tokens."""

    lrs: tuple[float, ...] = (5e-4, 1.5e-3, 4e-3)
    steps: int = 600
    tokens_per_micro_batch: int = 32768
    warmup_steps: int = 30
    selection_prompts: int = 100
    max_new_tokens: int = 256
    """Regeneration and validation answer length."""
    validation_prompts: int | None = None
    """Benchmark prompts validated (None: all 80 of each)."""
    parallel_runs: int = 9
    """Training (or validation) processes running at once, spread over the GPUs."""
    gpus: int | None = None
    """GPUs to use (None: every visible one; 0: none)."""
    seed: int = 0

    @classmethod
    def parse(cls, args: list[str]) -> Plan:
        """`FIELD=V` pairs; tuples are comma-separated."""
        values = {}
        for arg in args:
            key, value = arg.split("=", 1)
            default = getattr(cls, key)
            if isinstance(default, tuple):
                values[key] = tuple(float(v) for v in value.split(","))
            elif value == "None":
                values[key] = None
            else:
                values[key] = int(value)
        return cls(**values)


@dataclass(frozen=True)
class Job:
    name: str
    """Log file name."""
    module: str
    """Entry point run as `python -m`."""
    overrides: list[str]
    """Hydra overrides."""
    cost: float = 1.0
    """Relative GPU work, for spreading jobs over GPUs."""


class Runner:
    """Runs entry points as subprocesses, logging each command (for commands.sh) and its output."""

    def __init__(self, run_dir: Path, target: str, extra: list[str], gpus: int):
        self.run_dir, self.target, self.extra, self.gpus = run_dir, target, extra, gpus
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.commands = run_dir / "commands.sh"

    def command(self, module: str, overrides: list[str]) -> list[str]:
        common = ["model=smollm2_135m", f"model.target={self.target}", f"run_dir={self.run_dir}"]
        return [sys.executable, "-m", module, *common, *overrides, *self.extra]

    def start(self, job: Job, threads: int, gpu: int | None) -> subprocess.Popen:
        cmd = self.command(job.module, job.overrides)
        # Processes sharing the machine split its cores: each defaulting to all of them
        # oversubscribes the CPU, and a small head's training step is CPU-bound.
        env = {"OMP_NUM_THREADS": str(threads)}
        if gpu is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # index i is the parent's i-th GPU
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        with self.commands.open("a") as f:
            f.write(shlex.join([*(f"{k}={v}" for k, v in env.items()), "python", *cmd[1:]]) + "\n")
        log = (self.logs / f"{job.name}.log").open("a")
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )

    def run_all(self, jobs: list[Job], parallel: int) -> None:
        """Run the jobs, `parallel` at a time, the costliest first, each on the GPU with the least
        cost running; fail if any fails."""
        running: list[tuple[Job, int | None, subprocess.Popen]] = []
        failed: list[str] = []
        load = [0.0] * self.gpus
        threads = max(1, (os.cpu_count() or 1) // min(parallel, max(1, len(jobs))))
        for job in sorted(jobs, key=lambda j: -j.cost):
            while len(running) >= parallel:
                running = _reap(running, failed, load)
            gpu = min(range(self.gpus), key=load.__getitem__) if self.gpus else None
            if gpu is not None:
                load[gpu] += job.cost
            running.append((job, gpu, self.start(job, threads, gpu)))
        while running:
            running = _reap(running, failed, load)
        if failed:
            raise RuntimeError(f"failed: {failed}; see {self.logs}/<name>.log")


def _reap(running, failed: list[str], load: list[float]):
    """The jobs still running; the ended ones free their GPU's load, failures are recorded."""
    time.sleep(1)
    still = []
    for job, gpu, proc in running:
        rc = proc.poll()
        if rc is None:
            still.append((job, gpu, proc))
            continue
        if gpu is not None:
            load[gpu] -= job.cost
        if rc != 0:
            failed.append(f"{job.name} (exit {rc})")
    return still


def split_prompts(chat: Path, run_dir: Path, plan: Plan) -> tuple[Path, Path]:
    """A seeded sample of chat prompts for choosing learning rates; the rest are trained on, less
    the records the long-input set uses or shares a question with (`long_inputs.held_out`)."""
    train, selection = run_dir / "prompts/chat_train.jsonl", run_dir / "prompts/selection.jsonl"
    if not selection.exists():
        # split on "\n" only: splitlines() would also cut at U+2028 inside a JSON string
        lines = [line for line in chat.read_text(encoding="utf-8").split("\n") if line.strip()]
        chosen = set(random.Random(plan.seed).sample(range(len(lines)), plan.selection_prompts))
        held = long_inputs.held_out([json.loads(x) for x in lines], LONG_INPUTS)
        train.parent.mkdir(parents=True, exist_ok=True)
        kept = [x for i, x in enumerate(lines) if i not in chosen and not held[i]]
        train.write_text("".join(f"{x}\n" for x in kept))
        selection.write_text("".join(f"{lines[i]}\n" for i in sorted(chosen)))
    return train, selection


def unroll_steps(head: Head) -> int:
    """The chained steps a head trains on (its training costs about that many single steps)."""
    given = [int(o.split("=")[1]) for o in head.overrides if o.startswith("train.unroll_steps=")]
    return given[0] if given else 1


def run_name(head: Head, lr: float) -> str:
    return f"{head.name}/lr{lr:g}"


def training_overrides(head: Head, lr: float, run_dir: Path, selection: Path, plan: Plan) -> list[str]:
    return [
        *head.overrides,
        f"train.out_dir={run_dir / 'heads' / run_name(head, lr)}",
        f"train.lr={lr}",
        f"train.steps={plan.steps}",
        f"train.tokens_per_micro_batch={plan.tokens_per_micro_batch}",
        f"train.warmup_steps={plan.warmup_steps}",
        f"train.seed={plan.seed}",
        f"train.save_every={plan.steps // 3}",
        f"train.validate_every={plan.steps // 4}",
        f"train.spec_validate_at=[{plan.steps}]",
        f"validate.eval_files=[{selection}]",
        f"validate.num_prompts={plan.selection_prompts}",
        f"validate.batch_size={plan.selection_prompts}",
        f"validate.max_new_tokens={plan.max_new_tokens}",
        "validate.chain_lengths=[4]",
        "validate.teacher_forced_samples=64",
        "logging.log_every=10",
    ]


def last_validation(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "val/tau_k4" in r][-1]


def select(run_dir: Path, plan: Plan) -> dict[str, dict]:
    """Per head: each lr's final selection figures and the lr kept (highest τ at k = 4)."""
    chosen = {}
    for head in HEADS:
        sweep = {
            lr: last_validation(run_dir / "heads" / run_name(head, lr) / "metrics.jsonl") for lr in plan.lrs
        }
        best = max(plan.lrs, key=lambda lr: sweep[lr]["val/tau_k4"])
        chosen[head.name] = {"lr": best, "sweep": {f"{lr:g}": v for lr, v in sweep.items()}}
    return chosen


def shares(path: Path, n: int, run_dir: Path) -> list[Path]:
    """`path`'s records dealt into n files (record i to file i mod n); the file itself when n = 1."""
    if n == 1:
        return [path]
    parts = [run_dir / "prompts" / f"{path.stem}.share{i}of{n}.jsonl" for i in range(n)]
    if not all(p.exists() for p in parts):
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        for i, part in enumerate(parts):  # renamed into place: a killed write leaves no short share
            partial = part.with_suffix(".partial")
            partial.write_text("".join(f"{x}\n" for x in lines[i::n]), encoding="utf-8")
            partial.rename(part)
    return parts


def data_jobs(
    run_dir: Path, train_prompts: Path, gsm8k: Path, plan: Plan, gpus: int
) -> tuple[list[Job], list[Job]]:
    """Regeneration (one share of the prompts per GPU), then precompute; neither once the store
    exists."""
    if (run_dir / "store/manifest.json").exists():
        return [], []
    n = max(1, gpus)
    # the share count is in the name: a rerun with another GPU count starts its own files rather
    # than answering a share again next to a file that already holds it
    outputs = [run_dir / f"regenerated.share{i}of{n}.jsonl" for i in range(n)]
    regenerate = [
        Job(
            f"regenerate{i}",
            "mtp_train.regenerate",
            [
                f"regenerate.prompts=[{chat},{math}]",
                f"regenerate.output={out}",
                f"regenerate.max_new_tokens={plan.max_new_tokens}",
                "regenerate.batch_size=512",
                "regenerate.max_prompt_tokens=1024",
            ],
        )
        for i, (chat, math, out) in enumerate(
            zip(shares(train_prompts, n, run_dir), shares(gsm8k, n, run_dir), outputs)
        )
    ]
    precompute = [
        f"data.train_files=[{','.join(map(str, outputs))}]",
        "data.max_seq_len=2048",
        "precompute.tokens_per_batch=65536",
        "precompute.aux=true",  # the eagle3 heads' auxiliary states; the others read the last layer's
    ]
    return regenerate, [Job("precompute", "mtp_train.precompute", precompute)]


def sweep_jobs(run_dir: Path, selection: Path, plan: Plan) -> list[Job]:
    """Every (head, lr) run not finished yet."""
    return [
        Job(
            run_name(h, lr).replace("/", "_"),
            "mtp_train.train",
            training_overrides(h, lr, run_dir, selection, plan),
            cost=unroll_steps(h),
        )
        for h in HEADS
        for lr in plan.lrs
        if not (run_dir / "heads" / run_name(h, lr) / "train_summary.json").exists()
    ]


def validation_jobs(run_dir: Path, chosen: dict[str, dict], plan: Plan) -> list[Job]:
    """Each kept head on each benchmark, where its report is not written yet."""
    jobs = []
    for head in HEADS:
        head_dir = run_dir / "heads" / run_name(head, chosen[head.name]["lr"]) / "head"
        for bench, path in BENCHES.items():
            report = run_dir / "results" / f"{head.name}_{bench}.json"
            overrides = [
                f"validate.head={head_dir}",
                f"validate.eval_files=[{path}]",
                f"validate.report={report}",
                "validate.batch_size=80",
                f"validate.max_new_tokens={plan.max_new_tokens}",
                "validate.chain_lengths=[1,2,3,4,5]",
                "validate.temperatures=[0.0,1.0]",
                f"validate.num_prompts={plan.validation_prompts}".replace("None", "null"),
            ]
            if not report.exists():
                jobs.append(Job(f"validate_{head.name}_{bench}", "mtp_train.validate", overrides))
    return jobs


def run(target: str, chat: Path, gsm8k: Path, run_dir: Path, plan: Plan, extra: list[str]) -> None:
    run_dir = run_dir.resolve()
    gpus = visible_gpus() if plan.gpus is None else plan.gpus
    runner = Runner(run_dir, target, extra, gpus)
    times: dict[str, float] = {}

    def stage(name: str, jobs: list[Job], parallel: int) -> None:
        if jobs:  # a stage found done keeps the time an earlier run recorded
            start = time.perf_counter()
            runner.run_all(jobs, parallel)
            times[f"{name}_s"] = time.perf_counter() - start

    train_prompts, selection = split_prompts(chat, run_dir, plan)
    regenerate, precompute = data_jobs(run_dir, train_prompts, gsm8k, plan, gpus)
    stage("regenerate", regenerate, len(regenerate))
    stage("precompute", precompute, 1)
    stage("sweep", sweep_jobs(run_dir, selection, plan), plan.parallel_runs)
    chosen = select(run_dir, plan)
    stage("validate", validation_jobs(run_dir, chosen, plan), plan.parallel_runs)
    summary_path = run_dir / "experiment.json"
    earlier = json.loads(summary_path.read_text())["wall_s"] if summary_path.exists() else {}
    summary = {"plan": plan.__dict__, "gpus": gpus, "chosen": chosen, "wall_s": {**earlier, **times}}
    summary_path.write_text(json.dumps(summary, indent=2, default=list))
    print(json.dumps(summary, indent=2, default=list))


def visible_gpus() -> int:
    import torch  # here only: the driver itself never touches the GPU

    return torch.cuda.device_count()


def write_selection(run_dir: Path) -> dict[str, dict]:
    """Each head's last set-aside validation (`RUN_DIR/heads/<name>/metrics.jsonl`) into
    RUN_DIR/selection.json, and one line per head on stdout."""
    heads = sorted((run_dir / "heads").glob("*/metrics.jsonl"))
    rows = {m.parent.name: last_validation(m) for m in heads if "val/tau_k4" in m.read_text()}
    (run_dir / "selection.json").write_text(json.dumps(rows, indent=1))
    for name, row in rows.items():
        print(f"{name}: set-aside τ k=4 {row['val/tau_k4']:.3f}, acc@1 {row['val/accept_k4_pos1']:.3f}")
    return rows


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="python -m experiments.quality_smollm2",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = cli.add_subparsers(dest="command", required=True)
    run_cmd = sub.add_parser("run", help="the experiment end to end (resumable)")
    run_cmd.add_argument("target", help="the target: a Hugging Face directory")
    run_cmd.add_argument("chat", type=Path, help="the shared chat prompts (jsonl)")
    run_cmd.add_argument("gsm8k", type=Path, help="the GSM8K questions (jsonl)")
    run_cmd.add_argument("run_dir", type=Path, help="where every stage writes")
    run_cmd.add_argument(
        "overrides",
        nargs="*",
        metavar="plan.FIELD=V | KEY=V",
        help="changes to the Plan, or Hydra overrides passed to every stage",
    )
    report = sub.add_parser("report", help="a run's tables and training curves")
    report.add_argument("run_dir", type=Path)
    report.add_argument("out", type=Path, help="where tables.md, curves_<head>.png go")
    split = sub.add_parser("split-prompts", help="set the seeded selection prompts aside (RUN_DIR/prompts/)")
    split.add_argument("chat", type=Path, help="the shared chat prompts (jsonl)")
    split.add_argument("run_dir", type=Path)
    selection = sub.add_parser(
        "selection", help="each head's last set-aside validation into RUN_DIR/selection.json"
    )
    selection.add_argument("run_dir", type=Path)
    gguf = sub.add_parser("convert-gguf", help="a GGUF target as a Hugging Face directory")
    gguf.add_argument("gguf", type=Path)
    gguf.add_argument("out_dir", type=Path)
    return cli


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "run":
        plan = Plan.parse([a.removeprefix("plan.") for a in args.overrides if a.startswith("plan.")])
        extra = [a for a in args.overrides if not a.startswith("plan.")]
        run(args.target, args.chat, args.gsm8k, args.run_dir, plan, extra)
    elif args.command == "report":
        from experiments.quality_report import write_report

        write_report(args.run_dir, args.out)
    elif args.command == "split-prompts":
        split_prompts(args.chat, args.run_dir, Plan())
    elif args.command == "selection":
        write_selection(args.run_dir)
    elif args.command == "convert-gguf":
        from inference_ref.gguf import convert_gguf

        convert_gguf(args.gguf, args.out_dir)


if __name__ == "__main__":
    main()
