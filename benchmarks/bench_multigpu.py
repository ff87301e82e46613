"""N GPUs against one, on one node: sharded precompute, ZeRO-2/3 training, checkpoint + resume,
validation inside the training job.

    python -m benchmarks.bench_multigpu --gpus 2 --tokenizer SMOLLM2_DIR --data gsm8k_train.jsonl
    python -m benchmarks.bench_multigpu --gpus 2 --tokenizer SMOLLM2_DIR --target SMOLLM2_DIR \
        --model smollm2_135m --data a.jsonl,b.jsonl --sections precompute,train,validate \
        --zero 2

By default a random Llama (1B-class shape, SmolLM2's tokenizer) and the data files make the store;
`--target` uses a real model instead, whose loss falls, so the curves compare learning. Each run is
a real launch (`accelerate launch`), and the figures come from the runs' own outputs: the store
manifests, the precompute logs and the trainer's `metrics.jsonl`. The 1-GPU runs use the same global
batch as the N-GPU runs (accumulation N), so their loss curves must agree within bf16 noise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_result

REPO = Path(__file__).resolve().parent.parent

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)


def run(cmd: list[str], env: dict | None = None, log: Path | None = None) -> float:
    started = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    out = open(log, "w") if log else None
    done = subprocess.run(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        if log:
            print(log.read_text()[-4000:])
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - started


def launch(gpus: int, zero: int | None, module: str) -> list[str]:
    if zero is None:
        extra = ["--multi_gpu"] if gpus > 1 else []
        return ["accelerate", "launch", *extra, "--num_processes", str(gpus), "-m", module]
    config = f"launch/accelerate/zero{zero}_8gpu.yaml"
    return ["accelerate", "launch", "--config_file", config, "--num_processes", str(gpus), "-m", module]


def visible(gpus: int) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def curve_gap(a: dict, b: dict) -> float:
    steps = sorted(set(a) & set(b))
    return max(abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps)


def steady(m: dict, key: str) -> float:
    steps = sorted(m)[len(m) // 3 :]  # after warm-up and compilation
    return sum(m[s][key] for s in steps) / len(steps)


def precompute_rates(log: Path) -> list[float]:
    """Per-rank tokens/s as precompute prints them (model load excluded)."""
    return [float(x.replace(",", "")) for x in re.findall(r"\(([\d,]+) tok/s\)", log.read_text())]


def bench_precompute(n: int, work: Path, base: list[str]) -> dict:
    """1 GPU vs N: each sample exactly once across the ranks' shards, throughput per GPU."""
    from mtp_train.store import Store

    figures: dict = {}
    for g in (1, n):
        rd, log = work / f"pre{g}", work / f"pre{g}.log"
        shutil.rmtree(rd, ignore_errors=True)  # a store found complete would print no rates
        seconds = run(launch(g, None, "mtp_train.precompute") + base + [f"run_dir={rd}"], visible(g), log)
        manifest = json.loads((rd / "store" / "manifest.json").read_text())
        rates = precompute_rates(log)
        figures[f"precompute_{g}gpu"] = {
            "samples": manifest["num_samples"],
            "tokens": manifest["num_tokens"],
            "shards": len(manifest["shards"]),
            "ranks": sorted({s["rank"] for s in manifest["shards"]}),
            "seconds_incl_startup": seconds,
            "tokens_per_s_per_rank": rates,
        }
    one, many = Store(work / "pre1" / "store"), Store(work / f"pre{n}" / "store")
    figures["precompute_same_samples"] = sorted(one.sample_ids.tolist()) == sorted(many.sample_ids.tolist())
    figures["precompute_each_sample_once"] = len(set(many.sample_ids.tolist())) == len(many)
    per_gpu_n = sum(figures[f"precompute_{n}gpu"]["tokens_per_s_per_rank"]) / n
    figures["precompute_per_gpu_efficiency"] = (
        per_gpu_n / figures["precompute_1gpu"]["tokens_per_s_per_rank"][0]
    )
    return figures


def bench_training(n: int, work: Path, train: list[str], zeros: list[int], steps: int) -> dict:
    """ZeRO-2/3 on N GPUs vs 1 GPU at the same global batch (accumulation N)."""
    figures: dict = {}
    for zero in zeros:
        rd1, rdn = work / f"z{zero}_1", work / f"z{zero}_{n}"
        one = train + [f"run_dir={rd1}", f"train.grad_accum={n}"]
        run(launch(1, zero, "mtp_train.train") + one, visible(1), work / f"z{zero}_1.log")
        run(
            launch(n, zero, "mtp_train.train") + train + [f"run_dir={rdn}"],
            visible(n),
            work / f"z{zero}_{n}.log",
        )
        a, b = metrics(rd1), metrics(rdn)
        figures[f"zero{zero}"] = {
            "loss_curve_max_rel_gap": curve_gap(a, b),
            "first_loss": a[1]["loss"],
            "final_loss_1gpu": a[steps]["loss"],
            f"final_loss_{n}gpu": b[steps]["loss"],
            "tokens_per_s_1gpu": steady(a, "tokens_per_s"),
            f"tokens_per_s_{n}gpu": steady(b, "tokens_per_s"),
            "scaling_efficiency": steady(b, "tokens_per_s") / (n * steady(a, "tokens_per_s")),
            "peak_memory_gib_1gpu": max(r["peak_memory_gib"] for r in a.values()),
            f"peak_memory_gib_{n}gpu": max(r["peak_memory_gib"] for r in b.values()),
        }
    return figures


def bench_resume(n: int, work: Path, train: list[str], reference: Path) -> dict:
    """Checkpoint on N GPUs, SIGKILL, resume on N and (from the same checkpoint) on 1."""
    ckpt_args = train + ["train.save_every=10"]
    killed = work / "killed"
    cmd = launch(n, 2, "mtp_train.train") + ckpt_args + [f"run_dir={killed}"]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **visible(n)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    while not (killed / "train" / "ckpt-0000010").exists() and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    other = work / "resume_1"
    (other / "train").mkdir(parents=True, exist_ok=True)
    shutil.copytree(killed / "train" / "ckpt-0000010", other / "train" / "ckpt-0000010", dirs_exist_ok=True)
    run(
        launch(n, 2, "mtp_train.train") + ckpt_args + [f"run_dir={killed}"], visible(n), work / "resume_n.log"
    )
    figures = {"resume_same_n_max_rel_gap": curve_gap(metrics(reference), metrics(killed))}
    try:
        one = ckpt_args + [f"run_dir={other}", f"train.grad_accum={n}"]
        run(launch(1, 2, "mtp_train.train") + one, visible(1), work / "resume_1.log")
        figures["resume_on_1gpu_max_rel_gap"] = curve_gap(metrics(reference), metrics(other))
    except SystemExit as e:
        figures["resume_on_1gpu"] = f"failed: {e}"
    return figures


def bench_validation(n: int, work: Path, train: list[str], steps: int) -> dict:
    """Validation inside the training job (teacher-forced every 10 steps, greedy speculative at
    the end), on 1 GPU and sharded over N: each rank's time and how long the fastest waited."""
    validation = [
        "train.validate_every=10",
        f"train.spec_validate_at=[{steps}]",
        f"validate.eval_files=[{REPO / 'data/mt_bench.jsonl'}]",
        "validate.num_prompts=64",
        "validate.batch_size=64",
        "validate.max_new_tokens=128",
        "validate.chain_lengths=[3]",
        "validate.teacher_forced_samples=64",
    ]
    figures: dict = {}
    for g in (1, n):
        rd = work / f"val{g}"
        accumulate = [f"train.grad_accum={n}"] if g == 1 else []
        args = train + validation + accumulate + [f"run_dir={rd}"]
        run(launch(g, 2, "mtp_train.train") + args, visible(g), work / f"val{g}.log")
        rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
        figures[f"validation_{g}gpu"] = [
            {k: r[k] for k in r if k in VALIDATION_KEYS} for r in rows if "val/loss" in r
        ]
    return figures


VALIDATION_KEYS = ("step", "val/loss", "val/top1", "val/tau_k3", "val/seconds_max", "val/seconds_min")
SECTIONS = ("precompute", "train", "resume", "validate")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--work", default="/tmp/multigpu")
    p.add_argument(
        "--tokenizer", required=True, help="a directory with SmolLM2's tokenizer files and config.json"
    )
    p.add_argument("--data", required=True, help="jsonl file(s), comma-separated")
    p.add_argument("--target", help="a real target directory instead of the random 1B-class Llama")
    p.add_argument("--model", default="llama3_2_1b", help="the model recipe (with --target)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--zero", default="2,3", help="ZeRO stages to train with")
    p.add_argument("--sections", default=",".join(SECTIONS))
    args = p.parse_args()
    n, work = args.gpus, Path(args.work)
    sections = args.sections.split(",")
    work.mkdir(parents=True, exist_ok=True)
    target = Path(args.target) if args.target else work / "target"
    if not (target / "config.json").exists():
        from mtp_train.target_files import write_random_target

        write_random_target(target, args.tokenizer, seed=0, **SHAPE)
    base = [
        f"model={args.model if args.target else 'llama3_2_1b'}",
        f"model.target={target}",
        f"data.train_files=[{args.data}]",
        "data.max_seq_len=1024",
        "logging.log_every=1",
        "train.tokens_per_micro_batch=16384",
        "train.warmup_steps=5",
        f"train.steps={args.steps}",
        "train.save_every=0",
    ]
    command = " ".join(sys.argv[1:])
    figures: dict = {
        "command": f"python -m benchmarks.bench_multigpu {command}",
        "gpus": n,
        "target": str(args.target) if args.target else {"random": SHAPE},
    }
    if "precompute" in sections:
        figures.update(bench_precompute(n, work, base))
    train = base + [f"train.store_dir={work / f'pre{n}' / 'store'}"]
    if "train" in sections:
        figures.update(bench_training(n, work, train, [int(z) for z in args.zero.split(",")], args.steps))
    if "resume" in sections:
        if not (work / f"z2_{n}" / "train" / "metrics.jsonl").exists():
            sys.exit("--sections resume compares with the ZeRO-2 train run: add train (with --zero 2)")
        figures.update(bench_resume(n, work, train, work / f"z2_{n}"))
    if "validate" in sections:
        figures.update(bench_validation(n, work, train, args.steps))
    name = f"multigpu_{n}" + (f"_{args.model}" if args.target else "")
    write_result(name, figures)


if __name__ == "__main__":
    sys.exit(main())
