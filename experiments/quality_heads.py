"""What the quality experiment compares: the heads (each a set of Hydra overrides) and the benches.
Read by the driver (`quality_smollm2`) and the report (`quality_report`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Head:
    name: str
    overrides: tuple[str, ...]
    """Hydra overrides that make this head what it is."""


# Every head kind, with one step and with three chained steps (training-time test). The eagle3 heads
# read the store's auxiliary states: the experiment's store keeps them (`precompute.aux=true`), and
# the other heads read its last-layer columns.
HEADS = (
    Head("eagle1", ("model.variant=eagle1", "train.unroll_steps=1")),
    Head("eagle1_unroll3", ("model.variant=eagle1", "train.unroll_steps=3")),
    Head("restored", ("model.variant=rmsnorm-restored", "train.unroll_steps=1")),
    Head("restored_unroll3", ("model.variant=rmsnorm-restored", "train.unroll_steps=3")),
    Head("eagle3", ("model.variant=eagle3", "train.unroll_steps=1")),
    Head("eagle3_unroll3", ("model.variant=eagle3", "train.unroll_steps=3")),
)


BENCHES = {"mt_bench": REPO / "data/mt_bench.jsonl", "vicuna_bench": REPO / "data/vicuna_bench.jsonl"}
