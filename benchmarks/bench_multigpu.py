"""N GPUs against one, on one node: sharded precompute, ZeRO-2/3 training, checkpoint + resume.

    python -m benchmarks.bench_multigpu --gpus 2

A random Llama (1B-class shape, SmolLM2's tokenizer) and GSM8K (question → answer) make the
store. Each run is a real launch (`accelerate launch`), and the figures come from the runs' own
outputs: the store manifests and the trainer's `metrics.jsonl`. The 1-GPU runs use the same global
batch as the N-GPU runs (accumulation N), so their loss curves must agree within bf16 noise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_result

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
    config = f"recipes/accelerate/zero{zero}_8gpu.yaml"
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--work", default="/tmp/multigpu")
    p.add_argument(
        "--tokenizer", required=True, help="a directory with SmolLM2's tokenizer files and config.json"
    )
    p.add_argument("--data", required=True, help="GSM8K jsonl")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    n, work = args.gpus, Path(args.work)
    from mtp_train.targets import write_random_target

    target = work / "target"
    if not (target / "config.json").exists():
        write_random_target(target, args.tokenizer, seed=0, **SHAPE)
    base = [
        "model=llama3_2_1b",
        f"model.target={target}",
        f"data.train_files=[{args.data}]",
        "data.max_seq_len=1024",
        "logging.log_every=1",
        "train.tokens_per_micro_batch=16384",
        "train.warmup_steps=5",
        f"train.steps={args.steps}",
        "train.save_every=0",
    ]
    figures: dict = {"command": f"python -m benchmarks.bench_multigpu --gpus {n}", "gpus": n, "shape": SHAPE}

    # --- precompute: 1 GPU vs N GPUs ------------------------------------------------------------
    for g in (1, n):
        rd = work / f"pre{g}"
        seconds = run(
            launch(g, None, "mtp_train.precompute") + base + [f"run_dir={rd}"],
            visible(g),
            work / f"pre{g}.log",
        )
        manifest = json.loads((rd / "store" / "manifest.json").read_text())
        figures[f"precompute_{g}gpu"] = {
            "samples": manifest["num_samples"],
            "tokens": manifest["num_tokens"],
            "shards": len(manifest["shards"]),
            "ranks": sorted({s["rank"] for s in manifest["shards"]}),
            "seconds_incl_startup": seconds,
        }
    from mtp_train.store import Store

    one, many = Store(work / "pre1" / "store"), Store(work / f"pre{n}" / "store")
    figures["precompute_same_samples"] = sorted(one.sample_ids.tolist()) == sorted(many.sample_ids.tolist())
    figures["precompute_each_sample_once"] = len(set(many.sample_ids.tolist())) == len(many)
    store = work / f"pre{n}" / "store"

    # --- training: ZeRO-2 and ZeRO-3, N GPUs vs 1 GPU at the same global batch -------------------
    train = base + [f"train.store_dir={store}"]
    for zero in (2, 3):
        rd1, rdn = work / f"z{zero}_1", work / f"z{zero}_{n}"
        run(
            launch(1, zero, "mtp_train.train") + train + [f"run_dir={rd1}", f"train.grad_accum={n}"],
            visible(1),
            work / f"z{zero}_1.log",
        )
        run(
            launch(n, zero, "mtp_train.train") + train + [f"run_dir={rdn}"],
            visible(n),
            work / f"z{zero}_{n}.log",
        )
        a, b = metrics(rd1), metrics(rdn)
        figures[f"zero{zero}"] = {
            "loss_curve_max_rel_gap": curve_gap(a, b),
            "final_loss_1gpu": a[args.steps]["loss"],
            f"final_loss_{n}gpu": b[args.steps]["loss"],
            "tokens_per_s_1gpu": steady(a, "tokens_per_s"),
            f"tokens_per_s_{n}gpu": steady(b, "tokens_per_s"),
            "scaling_efficiency": steady(b, "tokens_per_s") / (n * steady(a, "tokens_per_s")),
            "peak_memory_gib_1gpu": max(r["peak_memory_gib"] for r in a.values()),
            f"peak_memory_gib_{n}gpu": max(r["peak_memory_gib"] for r in b.values()),
        }

    # --- checkpoint on N GPUs, kill, resume on N and on 1 ----------------------------------------
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
    resumed_n = killed
    run(
        launch(n, 2, "mtp_train.train") + ckpt_args + [f"run_dir={resumed_n}"],
        visible(n),
        work / "resume_n.log",
    )
    reference = metrics(work / f"z2_{n}")
    figures["resume_same_n_max_rel_gap"] = curve_gap(reference, metrics(resumed_n))
    other = work / "resume_1"
    (other / "train").mkdir(parents=True, exist_ok=True)
    os.system(f"cp -r {killed}/train/ckpt-0000010 {other}/train/")
    try:
        run(
            launch(1, 2, "mtp_train.train") + ckpt_args + [f"run_dir={other}", f"train.grad_accum={n}"],
            visible(1),
            work / "resume_1.log",
        )
        figures["resume_on_1gpu_max_rel_gap"] = curve_gap(reference, metrics(other))
    except SystemExit as e:
        figures["resume_on_1gpu"] = f"failed: {e}"
    write_result(f"multigpu_{n}", figures)


if __name__ == "__main__":
    sys.exit(main())
