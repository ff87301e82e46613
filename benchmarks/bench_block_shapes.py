"""`bench_verify_cost` with some of the skinny maps' block-shape candidates left out, to measure what
they buy in the same run (the tuning keeps the fastest per map shape, so more candidates win where
they time faster, within the timing's noise). The first argument says which:

- `no_swap`: the candidates before 2026-12-06 (no swapped tiles, none of the four one-row shapes
  added then; this A/B's "before" in docs/benchmarks.md, run 6);
- `all`: every candidate.

(`no_split` measured the split-K shapes, since taken out: docs/benchmarks.md, run 10.)

The arguments after the first are `bench_verify_cost`'s; without a --tag each run gets shapes_<which>.

    python -m benchmarks.bench_block_shapes no_swap --shape llama3_70b --compiled-layers \
        --batches 1 8 --new-tokens 1 2 4 8 --cached-kernel split --linear-kernel skinny
    python -m benchmarks.bench_block_shapes all ...
"""

from __future__ import annotations

import sys

import inference_ref.skinny_linear as skinny
from benchmarks import bench_verify_cost

ADDED_ONE_ROW = {(8, 1024, 4, 1), (8, 2048, 8, 1), (16, 1024, 8, 1), (16, 2048, 16, 1)}
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) of the one-row shapes added on 2026-12-06."""
_all = skinny._candidates


def left_out(which: str, tile: int, c: dict) -> bool:
    shape = (c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
    return which == "no_swap" and (c["SWAP"] or (tile == 1 and shape in ADDED_ONE_ROW))


def main() -> None:
    which, rest = (sys.argv[1:2] or [""])[0], sys.argv[2:]
    if which not in ("no_swap", "all"):
        sys.exit(f"bench_block_shapes: first argument {which!r}: no_swap or all")
    if "--tag" not in rest:  # each run its own file, neither the untagged one of bench_verify_cost
        rest += ["--tag", f"shapes_{which}"]

    def candidates(tile: int, gpu: bool = not skinny.INTERPRETED) -> list[dict]:
        return [c for c in _all(tile, gpu) if not left_out(which, tile, c)]

    skinny._candidates = candidates  # `_rope_candidates` filters these too
    bench_verify_cost.main(rest, "python -m benchmarks.bench_block_shapes " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
