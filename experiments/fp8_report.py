"""The FP8 experiment's table (docs/results.md): each (head's store, validation target) pair's
acceptance and τ at k = 4 with standard errors, and its parity gap.

    python -m experiments.fp8_report docs/results/fp8_run

Standard errors from the loop's counts: the accepted length L of one verify step has
P(L ≥ j) = accepted[j−1] / steps, so Var(L) follows exactly from the counts, and
se(τ) = sqrt(Var(L) / steps); se of the first-token rate is binomial. Both treat verify steps as
independent (steps of one answer are not quite), so they are lower bounds.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def tau_and_se(counts: dict) -> tuple[float, float]:
    steps = counts["steps"]
    reach = [a / steps for a in counts["accepted"]]  # P(L ≥ j), j = 1 … k
    mean = sum(reach)
    second = sum((2 * j - 1) * p for j, p in enumerate(reach, start=1))
    return 1 + mean, math.sqrt((second - mean**2) / steps)


def row(report: dict) -> dict:
    run = report["speculative"]["greedy"]["k=4"]
    counts = run["counts"]
    tau, se_tau = tau_and_se(counts)
    p = counts["accepted"][0] / counts["tried"][0]
    return {
        "tau": tau,
        "se_tau": se_tau,
        "acc1": p,
        "se_acc1": math.sqrt(p * (1 - p) / counts["tried"][0]),
        "rates": run["accept_rate"],
        "steps": counts["steps"],
        "parity_gap_ce": report["teacher_forced"]["parity_gap"]["ce"],
        "tf_ce": report["teacher_forced"]["inference"]["ce"],
    }


def table(results: Path) -> str:
    names = {"none": "bf16", "fp8": "FP8"}
    lines = [
        "| head trained on states of | validated against target | τ (k=4) ± se | acc@1 ± se | acc by position | teacher-forced CE | parity gap (CE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for head in ("none", "fp8"):
        for target in ("none", "fp8"):
            r = row(json.loads((results / f"report_head-{head}_target-{target}.json").read_text()))
            rates = ", ".join(f"{x:.3f}" for x in r["rates"])
            lines.append(
                f"| {names[head]} target | {names[target]} | {r['tau']:.3f} ± {r['se_tau']:.3f} | "
                f"{r['acc1']:.3f} ± {r['se_acc1']:.3f} | {rates} | {r['tf_ce']:.3f} | {r['parity_gap_ce']:.1e} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
