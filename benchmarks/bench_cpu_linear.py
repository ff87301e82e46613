"""A CPU's linear maps at a few rows, fp32: `F.linear` (x · Wᵀ, what a layer calls) against
`inference_ref.cpu_linear.apply_linear` ((W · xᵀ)ᵀ where its rule says so), for each map of a
SmolLM2-135M layer and its lm_head at 1 to 8 rows (a draft step or a verify of a batch of a few
prompts: the tests', the demo's and `validate`'s decoding on a CPU); then the speculative loop
with the published eagle3 head on the first 3 MT-bench questions (64 new tokens, k = 4, as
tests/test_vllm.py decodes them), with the rule off (`F.linear` everywhere) and on, in turn,
twice: both whatever this CPU's vendor picks (`cpu_linear.TRANSPOSED`, recorded beside them).

    python -m benchmarks.bench_cpu_linear [--threads 2] [--seconds 0.5] [--tag xeon]

Another CPU's instruction sets can be stood in for on this one: `MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2` before the command runs MKL's and PyTorch's AVX2 kernels (an AVX2 CPU
without AMX on an AVX-512 one); the result records both (`isa`).

Each map's figure is the median over repeats of one call; the two are timed in turn, in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import linear_shapes
from benchmarks.common import shape, write_result
from inference_ref import cpu_linear
from inference_ref.cpu_linear import apply_linear

REPO = Path(__file__).resolve().parents[1]

ROWS = (1, 2, 3, 4, 5, 6, 8)


def ms_per_call(fn, seconds: float) -> float:
    """Median ms of fn() over about `seconds` of repeats (after three warm-up calls)."""
    for _ in range(3):
        fn()
    times, spent = [], 0.0
    while spent < seconds or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times) * 1e3


@torch.inference_mode()
def measure(seconds: float) -> dict:
    cfg = shape("smollm2_135m")
    figures = {}
    for name, (out, inp) in linear_shapes(cfg).items():
        linear = torch.nn.Linear(inp, out, bias=False)
        for rows in ROWS:
            figures[f"{name}/{rows}"] = compared(linear, torch.randn(rows, inp), seconds)
            print(f"{name:13s} {rows} rows:", figures[f"{name}/{rows}"])
    return figures


def compared(linear: torch.nn.Linear, x: torch.Tensor, seconds: float) -> dict:
    """x · Wᵀ against `apply_linear` with the rule on ((W · xᵀ)ᵀ at the rows it covers)."""
    plain = ms_per_call(lambda: F.linear(x, linear.weight), seconds)
    with transposing(True):
        ours = ms_per_call(lambda: apply_linear(linear, x), seconds)
    return {
        "f_linear_ms": round(plain, 4),
        "apply_linear_ms": round(ours, 4),
        "speedup": round(plain / ours, 2),
    }


def cpu_model() -> str:
    """The CPU's model name and vendor (Linux), which `write_result`'s device leaves empty."""
    text = cpu_linear.cpuinfo()
    return " ".join(
        next(iter(cpu_linear.cpuinfo_values(text, key)), "") for key in ("vendor_id", "model name")
    )


def isa() -> dict:
    """The instruction sets this run's kernels used: PyTorch's own, and MKL's limit if one is set."""
    return {
        "aten": torch.backends.cpu.get_cpu_capability(),
        "mkl_limit": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
    }


@contextlib.contextmanager
def transposing(on: bool):
    """`apply_linear` with the rule on (a few rows as (W · xᵀ)ᵀ) or off (`F.linear` for any rows),
    whatever this CPU's vendor says (`cpu_linear.TRANSPOSED`)."""
    machine = cpu_linear.TRANSPOSED
    cpu_linear.TRANSPOSED = on
    try:
        yield
    finally:
        cpu_linear.TRANSPOSED = machine


def measure_loop() -> dict:
    """Seconds of the speculative loop with the published eagle3 head, the rule off and on, twice;
    and whether the four runs counted the same drafts and acceptances."""
    from transformers import AutoTokenizer

    from inference_ref.draft import load_draft
    from inference_ref.speculative import Chain, speculative_generate
    from inference_ref.target import eos_ids, load_target
    from mtp_train.data import load_prompts, prompt_ids
    from mtp_train.demo_target import smollm2_dir

    target_dir, head = smollm2_dir(), REPO / "heads" / "smollm2_135m" / "eagle3"
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    questions = load_prompts([REPO / "data" / "mt_bench.jsonl"], limit=3)
    ids = prompt_ids(tokenizer, [p.turns[0] for p in questions])
    target = load_target(target_dir, "cpu", torch.float32)
    draft = load_draft(head, target)
    eos = eos_ids(target, tokenizer)
    seconds, counts = {"off": [], "on": []}, set()
    for setting in ("off", "on", "off", "on"):
        with transposing(setting == "on"):
            start = time.perf_counter()
            stats = speculative_generate(target, draft, ids, 64, eos, Chain(4)).stats
            seconds[setting].append(round(time.perf_counter() - start, 2))
        counts.add((stats.tried[0], tuple(stats.accepted)))
        print(f"loop, rule {setting}: {seconds[setting][-1]} s, counts {counts}")
    return {"seconds": seconds, "counts_equal": len(counts) == 1, "counts": list(counts)[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=0.5, help="time spent on each figure")
    parser.add_argument("--tag", default="", help="appended to the result's name (another CPU's run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    maps = measure(args.seconds)
    write_result(
        "cpu_linear_smollm2_135m" + (f"_{args.tag}" if args.tag else ""),
        {
            "cpu": cpu_model(),
            "rule_on_this_cpu": cpu_linear.TRANSPOSED,
            "isa": isa(),
            "threads": args.threads,
            "maps": maps,
            "loop": measure_loop(),
        },
    )


if __name__ == "__main__":
    main()
