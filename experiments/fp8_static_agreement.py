"""How far the FP8 target's final-normed states are from the unquantized target's, with per-token
input scales (`quantize(model)`, the default) and with static ones (`quantize(model,
static_inputs=True)`, calibrated on other text first), on the real SmolLM2-135M-Instruct in fp32
on a CPU: the quantized products are the ones Hopper's FP8 tensor cores compute, up to
accumulation order (inference_ref/quantization.py).

    python -m experiments.fp8_static_agreement data/demo_prompts.jsonl OUT.json

The first `--calibrate` prompts (as chat-templated ids, packed) calibrate the static scales; the
next `--compare` prompts are compared, position by position.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.quantization import calibration, quantize
from inference_ref.target import load_target
from mtp_train.data import load_prompts, prompt_ids
from mtp_train.demo_target import smollm2_dir


def packed(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([t for seq in ids for t in seq]), cu_seqlens_of([len(seq) for seq in ids])


@torch.inference_mode()
def normed_states(model, ids: list[list[int]]) -> torch.Tensor:
    out, _ = model.forward_packed(*packed(ids))
    return model.norm(out).float()


def compare(a: torch.Tensor, ref: torch.Tensor, lm_head: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(a, ref, dim=-1)
    same = ((a @ lm_head.T).argmax(-1) == (ref @ lm_head.T).argmax(-1)).float().mean()
    return {
        "rel_rms_error_normed": float((a - ref).norm() / ref.norm()),
        "cosine_mean": float(cos.mean()),
        "cosine_p01": float(cos.quantile(0.01)),
        "next_token_top1_agreement": float(same),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--calibrate", type=int, default=48)
    p.add_argument("--compare", type=int, default=48)
    args = p.parse_args()
    target = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = load_prompts([Path(args.prompts)], limit=args.calibrate + args.compare)
    ids = prompt_ids(tokenizer, [q.turns[0] for q in prompts])
    calibration_ids, compared = ids[: args.calibrate], ids[args.calibrate :]

    model = load_target(target, "cpu", torch.float32)
    lm_head = model.lm_head.weight.float()
    ref = normed_states(model, compared)
    figures = {"target": "SmolLM2-135M-Instruct (fp32, CPU)", "compared_positions": ref.shape[0]}
    quantize(model)
    figures["fp8_per_token_inputs"] = compare(normed_states(model, compared), ref, lm_head)

    model = load_target(target, "cpu", torch.float32, quantization="fp8_static")
    with calibration(model):
        normed_states(model, calibration_ids)
    figures["calibration_positions"] = sum(map(len, calibration_ids))
    figures["fp8_static_inputs"] = compare(normed_states(model, compared), ref, lm_head)
    Path(args.out).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
