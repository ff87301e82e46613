"""Projected speed-ups of speculative decoding per target shape and batch size, from a head's
measured acceptance (a validation report) and the target's measured step costs
(`benchmarks/bench_verify_cost`: a verify of n new tokens per row, a draft step, as CUDA graphs):

    python -m mtp_train.projection REPORT.json benchmarks/results/verify_cost_llama3_8b.json …

A chain of k drafts emits τ(k) tokens per step for one verify of k + 1 tokens and k draft steps;
target-only decoding emits one token per one-token step, so

    speed-up(k, batch) = τ(k) · T_batch(1) / (T_batch(k + 1) + P(k) · D_batch)

with P(k) the draft's forwards per verify (from the report's `draft_layer_passes`): k for a chained
head, each a measured draft step (a random head's chained step, loaded as serving loads it: its
layer, the lm_head and the argmax; where the costs measured a step of the head's draft vocabulary,
`draft_step_ms_by_vocab`, an eagle3 head's with 32,000 rows, whichever kind the head is; else a
restored head's with the whole vocabulary) and, for L stacked layers, L − 1 more
layers at the target's own per-layer cost (its one-token step less the draft step, over its other
layers: the costs' `layers`); for a block drafter (DFlash) its layers, one forward of the whole block whatever k,
each layer costed as a one-token one-layer step (small forwards are weight-read and launch bound);
with τ(k) = 1 + Σ_{j ≤ k} Π_{i ≤ j} a_i from the greedy per-position acceptance a_i (conditional
on the drafts before it, so one measured chain gives τ for every shorter one). A greedy EAGLE-2 tree
of N nodes and depth d in the report emits its measured τ for one verify of N + 1 tokens and d
draft steps (each depth is one draft forward over that depth's nodes, costed as a one-token step:
small draft forwards are launch-bound); verify costs between the measured token counts are
interpolated linearly, past the last one extrapolated from the last two. The model counts
the forwards only: the loop's own work (sampling, acceptance, cache commits) is left out, which is
why it is checked against a measured wall-clock where one exists (`check`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def tau(rates: list[float], k: int) -> float:
    """Tokens per verify of a greedy chain of k drafts, from per-position acceptance rates."""
    total, reach = 1.0, 1.0
    for rate in rates[:k]:
        reach *= 0.0 if math.isnan(rate) else rate  # never tried: nothing before it was accepted
        total += reach
    return total


def speedup(
    rates: list[float],
    k: int,
    costs: dict,
    batch: str,
    passes: int | None = None,
    layers: int = 1,
    vocab: int | None = None,
) -> float:
    """`passes`: draft forwards per verify (None: k, a chained head's), of `layers` layers each;
    `vocab`: the head's draft vocabulary (None: the target's)."""
    step = chain_step_ms(costs, batch, k, passes, layers, vocab)
    return tau(rates, k) * costs["verify_ms"][batch]["1"] / step


def chain_step_ms(
    costs: dict, batch: str, k: int, passes: int | None = None, layers: int = 1, vocab: int | None = None
) -> float:
    """One speculative step of a chain of k: the measured verify of k + 1 tokens and the draft's
    forwards (`speedup`'s arguments)."""
    forwards = k if passes is None else passes
    return costs["verify_ms"][batch][str(k + 1)] + draft_ms(costs, batch, forwards, layers, vocab)


def draft_ms(costs: dict, batch: str, forwards: int, layers: int = 1, vocab: int | None = None) -> float:
    """`forwards` draft forwards of `layers` decoder layers each: the measured draft step (its
    layer, the lm_head, the argmax), plus each further layer at the target's per-layer cost."""
    step = draft_step_ms(costs, batch, vocab)
    if layers > 1:
        step += (layers - 1) * layer_ms(costs, batch)
    return forwards * step


def draft_step_ms(costs: dict, batch: str, vocab: int | None = None) -> float:
    """One draft step: with an lm_head of the head's draft vocabulary where the costs measured one of
    that size (`draft_step_ms_by_vocab`, an eagle3 head's 32,000 rows), else the whole vocabulary's."""
    return costs.get("draft_step_ms_by_vocab", {}).get(str(vocab), costs["draft_step_ms"])[batch]


def layer_ms(costs: dict, batch: str) -> float:
    """One decoder layer of the target's shape at this batch: its one-token step less the draft
    step (which has the lm_head and one layer), over its other layers. Since the draft step is a
    real head's (eager norms, the argmax: about 0.085 ms more than the stand-in's at 8B, batch 1,
    runs 14 and 15), a layer comes out that much over 31 layers lower, about 0.003 ms of 0.15."""
    if "layers" not in costs:
        raise ValueError(
            f"verify costs of {costs.get('shape')}: no 'layers' (the target's decoder layers), which a "
            "stacked head's extra layers are costed by: re-run benchmarks.bench_verify_cost"
        )
    return (costs["verify_ms"][batch]["1"] - costs["draft_step_ms"][batch]) / (costs["layers"] - 1)


def verify_ms(costs: dict, batch: str, tokens: int) -> float:
    """The verify cost of `tokens` new tokens per row, interpolated between the measured counts."""
    points = sorted((int(n), ms) for n, ms in costs["verify_ms"][batch].items())
    if tokens in dict(points):
        return dict(points)[tokens]
    lower = [p for p in points if p[0] < tokens]
    upper = [p for p in points if p[0] > tokens]
    # between two measured counts; past the last, the line through the last two
    (n0, t0), (n1, t1) = (lower[-1], upper[0]) if lower and upper else points[-2:]
    return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)


def tree_speedup(run: dict, costs: dict, batch: str, layers: int = 1, vocab: int | None = None) -> float:
    """A greedy tree's measured τ against one verify of its nodes + 1 tokens and `depth` draft
    forwards of `layers` layers each."""
    step = verify_ms(costs, batch, run["verify_tokens"]) + draft_ms(costs, batch, run["depth"], layers, vocab)
    return run["mean_accepted_len"] * costs["verify_ms"][batch]["1"] / step


def longest_chain(report: dict) -> dict:
    """The report's longest greedy chain (trees aside)."""
    runs = {n: r for n, r in report["speculative"]["greedy"].items() if r.get("draft", "chain") == "chain"}
    return runs[max(runs, key=lambda name: len(runs[name]["accept_rate"]))]


def draft_shape(run: dict, k: int) -> tuple[int, int]:
    """(forwards, layers each) per verify of a chain of k, from a report's run: a block drafter's
    layers once whatever k (each costed as a one-layer step), or k steps of a chained head's layers
    (its `draft_layer_passes` over its chain; reports from before the field had one layer)."""
    if run.get("block_drafter"):
        return run["draft_layer_passes"], 1
    chain = len(run["accept_rate"])
    return k, run.get("draft_layer_passes", chain) // chain


def project(report: dict, costs: dict) -> dict:
    """Projected speed-up per (batch, chain k or tree) on `costs`' shape, the best chain and the
    best draft overall per batch."""
    longest = longest_chain(report)
    rates = longest["accept_rate"]
    layers = draft_shape(longest, 1)[1]  # a stacked head's, per draft step (a tree's too)
    vocab = longest.get("draft_vocab_size")  # reports from before the field: the whole vocabulary
    measured = next(iter(costs["verify_ms"].values()))  # the new-token counts, alike for every batch
    chains = [k for k in range(1, len(rates) + 1) if str(k + 1) in measured]
    trees = {n: r for n, r in report["speculative"]["greedy"].items() if r.get("draft") == "tree"}
    table = {
        b: {k: speedup(rates, k, costs, b, *draft_shape(longest, k), vocab) for k in chains}
        for b in costs["verify_ms"]
    }
    best = {b: max(row, key=row.get) for b, row in table.items()}
    drafts = {
        b: {
            **{f"k={k}": v for k, v in row.items()},
            **{n: tree_speedup(r, costs, b, layers, vocab) for n, r in trees.items()},
        }
        for b, row in table.items()
    }
    overall = {b: max(row, key=row.get) for b, row in drafts.items()}
    return {
        "shape": costs["shape"],
        "speedup": {b: {name: round(v, 3) for name, v in row.items()} for b, row in drafts.items()},
        "draft_step_ms": {b: draft_step_ms(costs, b, vocab) for b in costs["verify_ms"]},
        "best_k": {b: f"k={k} ({table[b][k]:.2f}×)" for b, k in best.items()},
        "best": {b: f"{name} ({drafts[b][name]:.2f}×)" for b, name in overall.items()},
    }


def check(report: dict, costs: dict) -> dict | None:
    """The model against the report's own wall-clock, where the report was measured on this
    shape with CUDA graphs: projected vs measured speed-up at its batch size for each chain."""
    batch = str(report.get("batch_size"))
    if batch not in costs["verify_ms"]:
        return None
    out = {}
    for name, run in report["speculative"]["greedy"].items():
        k = len(run["accept_rate"])
        if not run.get("cuda_graph") or str(k + 1) not in costs["verify_ms"][batch]:
            continue
        projected = speedup(
            run["accept_rate"], k, costs, batch, *draft_shape(run, k), run.get("draft_vocab_size")
        )
        measured = run["speedup_vs_target_only"]
        out[name] = {"projected": projected, "measured": measured, "error": projected / measured - 1}
    return out or None


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a validation report (validate.report)")
    p.add_argument("costs", nargs="+", help="verify_cost_<shape>.json files (benchmarks/bench_verify_cost)")
    p.add_argument("--measured-on", help="the shape the report's own wall-clock was measured on: checked")
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    for path in args.costs:
        costs = json.loads(Path(path).read_text())
        figures = project(report, costs)
        if costs["shape"] == args.measured_on:
            figures["check_against_measured"] = check(report, costs)
        report.setdefault("projected", {})[costs["shape"]] = figures
        print(f"{costs['shape']}: best chain per batch size: {figures['best_k']}")
        if figures["best"] != figures["best_k"]:
            print(f"  best draft, trees included: {figures['best']}")
        if figures.get("check_against_measured"):
            print(f"  against the measured loop: {figures['check_against_measured']}")
    Path(args.report).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
