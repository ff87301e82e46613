"""The stages' entry points with a sharded target on GPUs, against the same stages in one process
(`benchmarks/tensor_parallel_gpu.sh` runs them): a random target directory at a small shape with
an untied vocabulary (so the vocab-parallel embedding and lm_head run), its regenerated answers and
precomputed stores compared.

    python -m benchmarks.tensor_parallel_entry target OUT_DIR TOKENIZER_DIR
    python -m benchmarks.tensor_parallel_entry compare RUN_TP1 RUN_TP2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks.common import write_result
from mtp_train.store import Store
from mtp_train.target_files import write_random_target

SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)


def answers(run: Path) -> dict[str, list]:
    lines = (run / "regenerated.jsonl").read_text().splitlines()
    return {r["id"]: r["messages"] for r in map(json.loads, lines)}


def compare(tp1: Path, tp2: Path) -> dict:
    a, b = answers(tp1), answers(tp2)
    s1, s2 = Store(tp1 / "store"), Store(tp2 / "store")
    s1.verify()
    s2.verify()
    # the TP 1 store's states against the TP 2 store's for the same sample (bf16 both)
    where2 = {int(k): i for i, k in enumerate(s2.sample_ids.tolist())}
    worst, sq_err, sq_ref, same_ids = 0.0, 0.0, 0.0, True
    for i, k in enumerate(s1.sample_ids.tolist()):
        ids1, mask1, h1 = s1.sample(i)
        ids2, mask2, h2 = s2.sample(where2[int(k)])
        same_ids &= torch.equal(ids1, ids2) and torch.equal(mask1, mask2)
        h1, h2 = h1.float(), h2.float()
        worst = max(worst, float((h2 - h1).abs().max() / h1.abs().max()))
        sq_err += float(((h2 - h1) ** 2).sum())
        sq_ref += float((h1**2).sum())
    return {
        "regenerated_conversations": len(a),
        "identical_conversations": sum(a[i] == b.get(i) for i in a) / max(1, len(a)),
        "store_samples": [len(s1), len(s2)],
        "store_ids_and_masks_equal": bool(same_ids),
        "store_hidden_max_rel_diff_per_sample": worst,
        "store_hidden_rel_rms_diff": (sq_err / sq_ref) ** 0.5,
        "store_world_size": [s1.manifest["world_size"], s2.manifest["world_size"]],
    }


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "target":
        write_random_target(rest[0], rest[1], seed=0, **SHAPE)
    else:
        write_result(
            "tensor_parallel_entry_points", {"shape": SHAPE, **compare(Path(rest[0]), Path(rest[1]))}
        )
