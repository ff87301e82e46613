"""What drafting costs per verify step, by head kind: the serving draft's own proposal
(`Draft.propose`: k chained steps, or one DFlash block forward) plus its refill after the verify
(`Draft.prefill` of the k + 1 verified positions), as one replayed CUDA graph, over a filled cache,
at the Llama-3.1-8B shape with random weights. This is the "draft cost per step" of #39: a chained
head pays k one-layer forwards and k lm_head passes, a DFlash block one forward of its layers and
one lm_head pass over its k rows.

    python -m benchmarks.bench_draft_cost --shape llama3_8b
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_verify_cost import CONTEXT, graphed
from benchmarks.common import DEVICE, DTYPE, shape, write_result
from inference_ref.head_spec import HEAD_KINDS, HeadSpec, resolve_class
from inference_ref.models import TARGET_KINDS
from mtp_train.heads import build

BATCHES = (1, 8, 32, 64)
KS = (3, 4, 5, 7)
HEADS = {  # name → (variant, draft layers); the 128k vocabulary's default draft vocabulary (32k) for all
    "eagle3": ("eagle3", 1),
    "rmsnorm-restored": ("rmsnorm-restored", 1),
    "dflash 1 layer": ("dflash", 1),
    "dflash 2 layers": ("dflash", 2),
    "dflash 5 layers": ("dflash", 5),
}


def serving_draft(cfg, target, variant: str, layers: int):
    kind = HEAD_KINDS[variant]
    aux = kind.aux_layers(None, cfg.num_hidden_layers, layers)
    block = dict(layers=layers, block_size=8, mask_token_id=0) if kind.blocks else {}
    spec = HeadSpec(variant, cfg, aux_layers=aux, draft_vocab_size=32_000, **block)
    frozen = {
        "model.embed_tokens.weight": target.embed_tokens.weight,
        "model.norm.weight": target.norm.weight,
        "lm_head.weight": target.lm_head.weight,
    }
    head = build(spec, frozen, torch.arange(32_000))
    tensors = {n: t.to(DTYPE) if t.is_floating_point() else t for n, t in head.state_dict().items()}
    return resolve_class(spec.kind.serving).from_tensors(spec, tensors, target), spec


@torch.inference_mode()
def costs(draft, spec, batch: int, k: int) -> float:
    cache = draft.new_cache(batch, CONTEXT + 2 * k + 2)
    cache.lengths.fill_(CONTEXT)
    width = (1 + len(spec.aux_layers)) * spec.target.hidden_size
    hidden = torch.randn(batch, k + 1, width, device=DEVICE, dtype=DTYPE)
    kept = torch.randint(0, spec.target.vocab_size, (batch, k + 1), device=DEVICE)
    last = kept[:, 0]
    y = torch.randn(batch, spec.target.hidden_size, device=DEVICE, dtype=DTYPE)

    def step():
        draft.prefill(hidden, kept, cache, static=True)  # the refill after a verify
        draft.propose(y, last, cache, k, 0.0, None, static=True)

    return graphed(step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    args = p.parse_args()
    cfg = shape(args.shape)
    one_layer = type(cfg)(**{**cfg.__dict__, "num_hidden_layers": 1})
    target = TARGET_KINDS[cfg.model_type].random(one_layer, DEVICE, DTYPE, 0)  # the shared tensors only
    results = {}
    for name, (variant, layers) in HEADS.items():
        draft, spec = serving_draft(cfg, target, variant, layers)
        results[name] = {str(b): {str(k): costs(draft, spec, b, k) for k in KS} for b in BATCHES}
        print(name, results[name], flush=True)
        del draft
        torch.cuda.empty_cache()
    write_result(
        f"draft_cost_{args.shape}",
        {
            "command": "python -m benchmarks.bench_draft_cost " + " ".join(sys.argv[1:]),
            "shape": args.shape,
            "context_tokens": CONTEXT,
            "draft_vocab_size": 32_000,
            "block_size": 8,
            "draft_ms_per_verify": results,
        },
    )


if __name__ == "__main__":
    main()
