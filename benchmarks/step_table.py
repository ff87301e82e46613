"""`bench_verify_cost` results side by side, as the markdown rows docs/benchmarks.md reports: per file
and batch, the decode step's ms (and its share of the weight-read limit) and each verify's cost as a
multiple of that decode step; #36's bar is 1.1×. `check_projection` results get a table of their
own: the measured and projected speed-ups, and the loop's replayed step against the projection's.
For A/Bs run in turn on one GPU:

    python -m benchmarks.step_table benchmarks/results/verify_cost_llama3_8b_*_ab*.json
    python -m benchmarks.step_table benchmarks/results/projection_check_llama3_8b_*_run15.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(result: dict) -> str:
    """Which of the tiles' options a run had on, and PDL when off, from the fields `bench_verify_cost`
    writes ("none": all off; the defaults moved, tile_activation on since 2026-12-07, so the label says
    what ran, not whether it was the default). A result older than an option lacks its field: a
    tile option reads as off (it did not exist), and "no PDL" is written only where the field says so."""
    options = [name for name in ("tile_activation", "tile_norm", "pdl_tiles") if result.get(name)]
    if not result.get("pdl", True):
        options.append("no PDL")
    return ", ".join(options) or "none"


def rows(name: str, result: dict) -> list[str]:
    """One markdown row per batch: the decode step, then each verify over the decode step."""
    lines = []
    for batch, costs in result["verify_ms"].items():
        decode = costs["1"]
        read = (result.get("decode_read") or {}).get(batch)
        share = f" ({100 * read['share_of_peak']:.1f} %)" if read else ""
        ratios = ", ".join(f"{n}: {ms / decode:.3f}×" for n, ms in costs.items() if n != "1")
        lines.append(f"| {name} | {label(result)} | {batch} | {decode:.3f}{share} | {ratios} |")
    return lines


def check_rows(name: str, result: dict) -> list[str]:
    """A projection check's markdown row: speed-ups measured and projected, the loop's
    replayed step and the projection's (absent before run 14: "–"), the host's work a step."""
    step = result.get("loop_step") or {}
    replayed = f"{step['step_ms']:.3f}" if step else "–"
    projected_step = result.get("projected_step_ms")
    step_error = result.get("step_relative_error")
    return [
        f"| {name} | {result.get('head', 'rmsnorm-restored')} | {result['batch']} "
        f"| {result['measured_speedup']:.3f} | {result['projected_speedup']:.3f} "
        f"| {100 * result['relative_error']:+.1f} % | {replayed} "
        f"| {f'{projected_step:.3f}' if projected_step else '–'} "
        f"| {f'{100 * step_error:+.1f} %' if step_error is not None else '–'} "
        f"| {result['host_ms_per_step']:.3f} |"
    ]


TABLES = {  # the field a result of the kind has → its file prefix, header, rows
    "verify_ms": (
        "verify_cost_",
        "| file | options | batch | decode ms (read limit) | verify / decode by new tokens |",
        rows,
    ),
    "projected_speedup": (
        "projection_check_",
        "| file | head | batch | measured | projected | error | loop step ms | projection's step ms "
        "| step error | host ms a step |",
        check_rows,
    ),
}


def markdown(field: str, named: list[tuple[Path, dict]]) -> str:
    """The table of `TABLES[field]`'s kind, one file's rows after another."""
    prefix, header, make = TABLES[field]
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for file, result in named:
        lines += make(file.stem.removeprefix(prefix), result)
    return "\n".join(lines)


def tables(files: list[Path]) -> str:
    """The verify costs' table and the projection checks' table, for whichever of each `files` has,
    in the order given."""
    kinds: dict[str, list] = {field: [] for field in TABLES}
    for file in files:
        result = json.loads(file.read_text())
        field = next((field for field in TABLES if field in result), None)
        if field is None:
            raise ValueError(f"{file}: neither a bench_verify_cost nor a check_projection result")
        kinds[field].append((file, result))
    return "\n\n".join(markdown(field, named) for field, named in kinds.items() if named)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "files", nargs="+", type=Path, help="bench_verify_cost and check_projection JSONs, in the order run"
    )
    try:
        print(tables(p.parse_args(argv).files))
    except ValueError as e:
        raise SystemExit(f"step_table: {e}") from None


if __name__ == "__main__":
    main()
