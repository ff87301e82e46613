"""`bench_verify_cost` results side by side, as the markdown rows docs/benchmarks.md reports: per file
and batch, the decode step's ms (and its share of the weight-read limit) and each verify's cost as a
multiple of that decode step; #36's bar is 1.1×. For A/Bs run in turn on one GPU:

    python -m benchmarks.step_table benchmarks/results/verify_cost_llama3_8b_*_ab*.json
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


def table(files: list[Path]) -> str:
    header = "| file | options | batch | decode ms (read limit) | verify / decode by new tokens |"
    lines = [header, "|---|---|---|---|---|"]
    for file in files:
        result = json.loads(file.read_text())
        if "verify_ms" not in result:
            raise ValueError(f"{file}: no 'verify_ms' (not a bench_verify_cost result)")
        lines += rows(file.stem.removeprefix("verify_cost_"), result)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_verify_cost JSONs, in the order run")
    try:
        print(table(p.parse_args(argv).files))
    except ValueError as e:
        raise SystemExit(f"step_table: {e}") from None


if __name__ == "__main__":
    main()
