"""`bench_verify_cost` with the skinny maps' block-shape candidates as they were before 2026-12-06
("before": no swapped tiles, none of the four one-row shapes added then) or as they are ("after"),
to measure what the added candidates buy in the same run (the tuning keeps the fastest per map
shape, so more candidates win where they time faster, within the timing's noise). The arguments
after the first are `bench_verify_cost`'s; without a --tag each half gets shapes_before or shapes_after.

    python -m benchmarks.bench_block_shapes before --shape llama3_8b --compiled-layers \
        --batches 1 8 16 --new-tokens 1 2 4 8 --cached-kernel split --linear-kernel skinny
    python -m benchmarks.bench_block_shapes after  ...
"""

from __future__ import annotations

import sys

import inference_ref.skinny_linear as skinny
from benchmarks import bench_verify_cost

ADDED_ONE_ROW = {(8, 1024, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 1), (16, 2048, 16, 1)}
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) of the one-row shapes added on 2026-12-06."""
_all = skinny._candidates


def candidates_before(tile: int, gpu: bool = not skinny.INTERPRETED) -> list[dict]:
    def added(c: dict) -> bool:
        shape = (c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
        return c["SWAP"] or (tile == 1 and shape in ADDED_ONE_ROW)

    return [c for c in _all(tile, gpu) if not added(c)]


def main() -> None:
    which, rest = (sys.argv[1:2] or [""])[0], sys.argv[2:]
    if which not in ("before", "after"):
        sys.exit(f"bench_block_shapes: first argument {which!r}: before or after")
    if "--tag" not in rest:  # each half its own file, neither the untagged one of bench_verify_cost
        rest += ["--tag", f"shapes_{which}"]
    if which == "before":
        skinny._candidates = candidates_before  # `_rope_candidates` filters these too
    bench_verify_cost.main(rest, "python -m benchmarks.bench_block_shapes " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
