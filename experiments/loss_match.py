"""Do training curves match? Heads trained on the same data and plan with another precision or
trainer (one process in bf16 or fp32, DeepSpeed ZeRO-2), each curve from its `metrics.jsonl`.

    python -m experiments.loss_match RUN_DIR NAME [NAME ...]   # RUN_DIR/heads/NAME/metrics.jsonl

For each head: the final loss (the mean of the logged windows of the last `--tail` steps) and its
noise (the standard error of that mean, from the windows' spread around their linear trend, which
the falling loss would otherwise inflate); then for each head against the first, the final
difference in units of the noise of the difference, and the largest gap between the two curves.
Written to RUN_DIR/loss_match.json and printed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def curve(metrics: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {r["step"]: r[key] for r in rows if key in r and "step" in r}


def final(points: dict[int, float], tail: int) -> tuple[float, float]:
    """The mean of the last `tail` steps' windows and its standard error around their trend."""
    last = max(points)
    xs = [s for s in sorted(points) if s > last - tail]
    ys = [points[s] for s in xs]
    n = len(ys)
    if n < 3:
        raise ValueError(f"{n} logged windows in the last {tail} steps: too few to tell noise from trend")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    residuals = [y - my - slope * (x - mx) for x, y in zip(xs, ys)]
    sd = math.sqrt(sum(r * r for r in residuals) / (n - 2))
    return my, sd / math.sqrt(n)


def compare(run_dir: Path, names: list[str], key: str, tail: int) -> dict:
    curves = {n: curve(run_dir / "heads" / n / "metrics.jsonl", key) for n in names}
    heads = {}
    for n, points in curves.items():
        mean, se = final(points, tail)
        heads[n] = {"final": mean, "standard_error": se, "steps": max(points)}
    base = names[0]
    for n in names[1:]:
        shared = sorted(set(curves[n]) & set(curves[base]))
        gaps = [abs(curves[n][s] - curves[base][s]) for s in shared]
        diff = heads[n]["final"] - heads[base]["final"]
        noise = math.hypot(heads[n]["standard_error"], heads[base]["standard_error"])
        heads[n][f"vs_{base}"] = {
            "final_difference": diff,
            "in_noise_units": diff / noise if noise else None,
            "within_noise": abs(diff) <= 2 * noise,
            "largest_gap": max(gaps) if gaps else None,
            "largest_gap_at_step": shared[gaps.index(max(gaps))] if gaps else None,
        }
    return {"metric": key, "tail_steps": tail, "heads": heads}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("names", nargs="+", help="heads under RUN_DIR/heads/, the first the baseline")
    p.add_argument("--metric", default="loss")
    p.add_argument("--tail", type=int, default=100, help="the last steps whose windows make the final figure")
    args = p.parse_args(argv)
    result = compare(args.run_dir, args.names, args.metric, args.tail)
    (args.run_dir / "loss_match.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
