"""How far the FP8 target's states are from the bf16 target's on the same text: two stores of one
regenerated set (experiments/fp8_smollm2.sh), compared sample by sample after the final norm.

    python -m experiments.fp8_agreement TARGET_DIR STORE_BF16 STORE_FP8 OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from inference_ref.causal_lm import rms_norm
from inference_ref.target import frozen_target_tensors, read_target_config
from mtp_train.store import Store


def agreement(target: Path, bf16: Store, fp8: Store, samples: int = 2000) -> dict:
    cfg = read_target_config(target)
    weight = frozen_target_tensors(target)["model.norm.weight"].float()
    lm_head = frozen_target_tensors(target)["lm_head.weight"].float()
    where = {int(k): i for i, k in enumerate(fp8.sample_ids.tolist())}
    sq_err = sq_ref = 0.0
    cosines, worst, same_top1, positions = [], 0.0, 0, 0
    for i, k in enumerate(bf16.sample_ids.tolist()[:samples]):
        _, _, a = bf16.sample(i)
        _, _, b = fp8.sample(where[int(k)])
        a = rms_norm(a.float(), weight, cfg.rms_norm_eps)
        b = rms_norm(b.float(), weight, cfg.rms_norm_eps)
        sq_err += float(((b - a) ** 2).sum())
        sq_ref += float((a**2).sum())
        cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
        worst = max(worst, float(((b - a).norm(dim=-1) / a.norm(dim=-1)).max()))
        same_top1 += int(((a @ lm_head.T).argmax(-1) == (b @ lm_head.T).argmax(-1)).sum())
        positions += a.shape[0]
    cos = torch.cat(cosines)
    return {
        "samples": min(samples, len(bf16)),
        "positions": positions,
        "rel_rms_error_normed": (sq_err / sq_ref) ** 0.5,
        "max_per_token_rel_error_normed": worst,
        "cosine_mean": float(cos.mean()),
        "cosine_p01": float(cos.quantile(0.01)),
        "next_token_top1_agreement": same_top1 / positions,
    }


if __name__ == "__main__":
    target, a, b, out = sys.argv[1:]
    figures = agreement(Path(target), Store(Path(a)), Store(Path(b)))
    Path(out).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
