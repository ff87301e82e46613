"""The validation report: its fingerprint (`report_fingerprint`: a rerun with nothing changed
reuses it), the measured verify costs it projects with (`verify_costs`), the JSON and the PNG
plots (`write_report`), and the report in words (`summary`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train.config import ConfigError, RunConfig


def report_fingerprint(cfg: RunConfig) -> str:
    """What a report depends on: the head's files, the target, the validation and data settings.
    A rerun with all of them unchanged reuses the report instead of decoding again."""
    head = Path(cfg.validate.head)
    h = hashlib.sha256()
    for name in ("config.json", "head.safetensors", "model.safetensors"):  # native or engine export
        h.update((head / name).read_bytes() if (head / name).exists() else b"")
    settings = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "validate", "data")}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def verify_costs(path: str) -> dict:
    if not Path(path).is_file():
        raise ConfigError(
            f"validate.verify_costs: {path} does not exist (measure a shape with python -m "
            "benchmarks.bench_verify_cost; benchmarks/results/verify_cost_*.json hold the H200's)"
        )
    return json.loads(Path(path).read_text())


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    plot_acceptance(report, path.with_suffix(".png"))


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, projected = report["speculative"], report.get("projected", {})
    rows = 3 if projected else 2
    columns = max(len(modes), len(projected))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax, (shape, figures) in zip(axes[2] if projected else [], projected.items()):
        plot_projection(ax, shape, figures)
    for ax in [
        *axes[0][len(modes) :],
        *axes[1][len(modes) :],
        *(axes[2][len(projected) :] if projected else []),
    ]:
        ax.axis("off")
    for ax, budgets, (mode, runs) in zip(axes[0], axes[1], modes.items()):
        for name, run in runs.items():
            if "saguaro" in run:
                continue  # Saguaro sampling is in the SSD lines of the summary
            rates = run["accept_rate"]
            ax.plot(
                range(1, len(rates) + 1),
                rates,
                marker="o",
                linestyle="--" if run.get("draft") == "tree" else "-",
                label=f"{name}  τ={run['mean_accepted_len']:.2f}",
            )
        ax.set(
            title=f"acceptance by position ({mode})",
            xlabel="draft position j (a tree: depth j)",
            ylabel="accept rate",
            ylim=(0, 1),
        )
        ax.legend(fontsize=8)
        plot_budgets(budgets, mode, runs)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_projection(ax, shape: str, figures: dict) -> None:
    """Projected speed-up (greedy) against batch size on a target shape, one line per draft."""
    batches = sorted(figures["speedup"], key=int)
    for draft in figures["speedup"][batches[0]]:
        ax.plot(
            [int(b) for b in batches],
            [figures["speedup"][b][draft] for b in batches],
            marker="o",
            linestyle="--" if draft.startswith("tree") else "-",
            label=draft,
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(
        title=f"projected speed-up on {shape} (greedy)",
        xlabel="batch size",
        ylabel="× target-only decoding",
    )
    ax.legend(fontsize=8)


def plot_budgets(ax, mode: str, runs: dict) -> None:
    """τ against the tokens one verify forward processes: chains and trees at equal verify budgets."""
    for draft in ("chain", "tree"):
        points = sorted(
            (run["verify_tokens"], run["mean_accepted_len"])
            for run in runs.values()
            if run.get("draft", "chain") == draft and "verify_tokens" in run and "saguaro" not in run
        )
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="--" if draft == "tree" else "-", label=draft)
    ax.set_xscale("log", base=2)
    ax.set(
        title=f"τ by verify budget ({mode})",
        xlabel="tokens per verify forward (chain: k + 1, tree: nodes + 1)",
        ylabel="τ (tokens per verify)",
    )
    ax.legend(fontsize=8)


def draft_words(name: str, run: dict) -> str:
    """A report entry's draft in words, with the tokens its verify forward processes."""
    if run.get("draft") == "tree":
        return (
            f"a tree of {run['nodes']} draft nodes (depth ≤ {run['depth']}, top-{run['top_k']} "
            f"expansion), {run['verify_tokens']} tokens per verify"
        )
    verify = f", {run['verify_tokens']} tokens per verify" if "verify_tokens" in run else ""
    if "saguaro" in run:
        s = run["saguaro"]
        return (
            f"k={run['k']} draft tokens per step{verify}, drafted with Saguaro sampling (the draft's "
            f"top {s['fan_out']} + 1 tokens weighted by {s['factor']:g})"
        )
    return f"{name} draft tokens per step{verify}"


def equal_budgets(mode: str, runs: dict) -> list[str]:
    """A line of τ by tokens per verify forward, chains beside trees, where the report has trees."""
    by_size: dict[int, dict[str, float]] = {}
    for run in runs.values():
        if "verify_tokens" in run and "saguaro" not in run:
            by_size.setdefault(run["verify_tokens"], {})[run.get("draft", "chain")] = run["mean_accepted_len"]
    if not any("tree" in drafts for drafts in by_size.values()):
        return []
    cells = [
        f"{size}: " + ", ".join(f"{draft} {tau:.2f}" for draft, tau in sorted(drafts.items()))
        for size, drafts in sorted(by_size.items())
    ]
    head = f"{mode}, τ by tokens per verify forward (chains and trees at equal verify budgets): "
    return [head + "; ".join(cells)]


def summary(report: dict) -> str:
    """The report in words: what each figure is, and how to read it."""
    tf = report["teacher_forced"]
    text = "held-out training records" if tf.get("text") == "data.holdout" else "the target's own answers"
    lines = [
        f"teacher-forced on {text} ({tf['inference']['positions']} positions): the head's next-token "
        f"cross-entropy {tf['inference']['ce']:.3f} against the target, top-1 agreement {tf['inference']['top1']:.3f}",
        f"  (the training code computes {tf['trainer']['ce']:.3f} / {tf['trainer']['top1']:.3f} on the same text: "
        f"train/serve gap {tf['parity_gap']['ce']:.1e}; this top-1 differs from training's, which was on training text)",
    ]
    for mode, runs in report["speculative"].items():
        for name, run in runs.items():
            rates = ", ".join(f"{r:.2f}" for r in run["accept_rate"])
            token_j = "a draft token at depth j" if run.get("draft") == "tree" else "draft token j"
            lines.append(
                f"speculative decoding, {mode}, {draft_words(name, run)}: {run['mean_accepted_len']:.2f} "
                f"tokens per target step (τ); {token_j} accepted (given the ones before): {rates}"
            )
            if run.get("identical_to_target_greedy") is not None:
                lines.append(
                    f"  output identical to the target decoding alone: {run['identical_to_target_greedy']} "
                    f"({run['identical_answers']:.0%} of answers)"
                )
            if run.get("by_category"):
                taus = ", ".join(f"{c} {v['mean_accepted_len']:.2f}" for c, v in run["by_category"].items())
                lines.append(f"  τ by prompt category: {taus}")
            if "ssd_hit_rate" in run:
                hits = ", ".join(f"F={f}: {r:.2f}" for f, r in run["ssd_hit_rate"].items())
                lines.append(
                    "  SSD: verifies whose outcome (accepted count and the target's token) is among the "
                    f"draft's top F predictions per position (an asynchronous drafter's cache hits): {hits}"
                )
            lines.append(
                f"  {run['speedup_vs_target_only']:.2f}× the target's own speed in this reference loop "
                "(on a CPU or a 135M target the loop's overheads dominate: read τ, not this, for serving)"
            )
        lines += equal_budgets(mode, runs)
    lines += engine_summary(report["engine"]) if "engine" in report else []
    for shape, figures in report.get("projected", {}).items():
        best = ", ".join(f"batch {b}: {v}" for b, v in figures["best"].items())
        lines.append(
            f"projected on the {shape} shape's measured step costs, the best draft per batch: {best}"
        )
    return "\n".join(lines)


def engine_summary(engine: dict) -> list[str]:
    """validate.engine's figures beside ours, in words."""
    lines = [f"vLLM {engine['version']} on the same {engine['answers']} prompts"]
    if "target_only" in engine:
        lines[0] += (
            f": its target alone answers {engine['target_only']['identical_to_inference_ref']:.0%} of them "
            "as inference_ref's target does"
        )
    for mode, runs in engine["speculative"].items():
        for name, run in runs.items():
            gap = run["gap"]
            same = (
                "counts equal to ours"
                if gap["counts_equal"]
                else f"counts {run['counts']} vs ours {gap['ours']}"
            )
            line = (
                f"  vLLM, {mode}, {name}: τ {run['mean_accepted_len']:.2f} (ours {gap['tau_ours']:.2f}, "
                f"engine gap {gap['tau_gap']:+.3f}); {same}"
            )
            if run["identical_to_vllm_target"] is not None:
                line += f"; {run['identical_to_vllm_target']:.0%} of answers identical to vLLM's target alone"
            elif run.get("identical_to_inference_ref_target") is not None:
                line += (
                    f"; {run['identical_to_inference_ref_target']:.0%} of answers identical to "
                    "inference_ref's target alone"
                )
            lines.append(line)
    return lines
