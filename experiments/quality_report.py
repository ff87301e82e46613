"""Tables and training curves of a quality-experiment run (see `experiments/quality_smollm2.py`).

Writes OUT/tables.md (markdown, quoted by docs/results.md) and OUT/curves_<head>.png, and returns
the headline figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.quality_heads import BENCHES, HEADS

MODES = ("greedy", "T=1")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def acceptance_table(reports: dict[str, dict], mode: str) -> list[str]:
    """One row per head: acceptance at positions 1…5 (k = 5 run) and τ for k = 1…5."""
    lines = [
        "| head | acc@1 | acc@2 | acc@3 | acc@4 | acc@5 | τ k=1 | τ k=2 | τ k=3 | τ k=4 | τ k=5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, report in reports.items():
        runs = report["speculative"][mode]
        rates = runs["k=5"]["accept_rate"]
        taus = [runs[f"k={k}"]["mean_accepted_len"] for k in range(1, 6)]
        cells = [f"{r:.3f}" for r in rates] + [f"{t:.2f}" for t in taus]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def speed_table(reports: dict[str, dict]) -> list[str]:
    lines = [
        "| head | target-only new tok/s | greedy k=4 tok/s | speed-up | greedy identical to target | "
        "teacher-forced CE (inference / trainer path) | parity gap (CE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in reports.items():
        run = r["speculative"]["greedy"]["k=4"]
        tf = r["teacher_forced"]
        lines.append(
            f"| {name} | {r['target_only']['tokens_per_s']:,.0f} | {run['tokens_per_s']:,.0f} | "
            f"{run['speedup_vs_target_only']:.2f}× | {run.get('identical_to_target_greedy')} | "
            f"{tf['inference']['ce']:.4f} / {tf['trainer']['ce']:.4f} | {tf['parity_gap']['ce']:.1e} |"
        )
    return lines


def sweep_table(run_dir: Path, experiment: dict) -> list[str]:
    lines = [
        "| head | lr | selection τ (k=4, greedy) | selection acc@1 | held-out CE | last train loss | "
        "tokens | run time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for head in HEADS:
        chosen = experiment["chosen"][head.name]
        for lr, val in chosen["sweep"].items():
            trained = json.loads(
                (run_dir / "heads" / head.name / f"lr{lr}" / "train_summary.json").read_text()
            )
            mark = " **(kept)**" if float(lr) == chosen["lr"] else ""
            lines.append(
                f"| {head.name} | {lr}{mark} | {val['val/tau_k4']:.3f} | {val['val/accept_k4_pos1']:.3f} | "
                f"{val['val/loss']:.4f} | {trained['loss']:.4f} | {trained['tokens']:,} | {trained['seconds']:.0f} |"
            )
    return lines


def plot_curves(run_dir: Path, experiment: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for head in HEADS:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for lr in experiment["chosen"][head.name]["sweep"]:
            rows = read_jsonl(run_dir / "heads" / head.name / f"lr{lr}" / "metrics.jsonl")
            train = [r for r in rows if "loss" in r]
            val = [r for r in rows if "val/loss" in r]
            kept = float(lr) == experiment["chosen"][head.name]["lr"]
            style = {"label": f"lr {lr}" + (" (kept)" if kept else ""), "lw": 2 if kept else 1}
            axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], **style)
            axes[1].plot([r["step"] for r in train], [r["top1"] for r in train], **style)
            axes[2].plot([r["step"] for r in val], [r["val/loss"] for r in val], marker="o", **style)
        titles = ("training loss", "training top-1 (chain step 1)", "held-out CE (inference path)")
        for ax, title in zip(axes, titles):
            ax.set(title=f"{head.name}: {title}", xlabel="step")
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"curves_{head.name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def headline(reports: dict[str, dict[str, dict]]) -> dict:
    """The claim's figures on MT-bench, greedy: first-token acceptance (k = 1) and τ at k = 4."""
    mt = reports["mt_bench"]
    first = {h: mt[h]["speculative"]["greedy"]["k=1"]["accept_rate"][0] for h in mt}
    tau4 = {h: mt[h]["speculative"]["greedy"]["k=4"]["mean_accepted_len"] for h in mt}
    return {
        "first_token_acceptance": first,
        "tau_k4": tau4,
        "restored_minus_eagle1_points": 100 * (first["restored"] - first["eagle1"]),
    }


def write_report(run_dir: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    experiment = json.loads((run_dir / "experiment.json").read_text())
    reports = {
        bench: {
            h.name: json.loads((run_dir / "results" / f"{h.name}_{bench}.json").read_text()) for h in HEADS
        }
        for bench in BENCHES
    }
    lines = ["<!-- written by `python -m experiments.quality_smollm2 report`; do not edit -->", ""]
    for bench, by_head in reports.items():
        some = next(iter(by_head.values()))
        for mode in MODES:
            lines += [f"### {bench}, {mode} ({some['prompts']} prompts, {some['turns']} turns)", ""]
            lines += acceptance_table(by_head, mode) + [""]
        lines += [f"### {bench}: speed and teacher-forced figures (k = 4)", ""]
        lines += speed_table(by_head) + [""]
    lines += ["### Learning-rate sweeps (selection on set-aside training prompts)", ""]
    lines += sweep_table(run_dir, experiment) + [""]
    wall = experiment["wall_s"]
    lines += ["### Wall-clock on the GPU (s)", "", "| " + " | ".join(wall) + " |", "|---" * len(wall) + "|"]
    lines += ["| " + " | ".join(f"{v:.0f}" for v in wall.values()) + " |", ""]
    (out / "tables.md").write_text("\n".join(lines))
    plot_curves(run_dir, experiment, out)
    figures = headline(reports)
    (out / "headline.json").write_text(json.dumps(figures, indent=2))
    return figures
