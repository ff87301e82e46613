"""The projection model (`mtp_train.projection`) against a measured wall-clock on the same GPU: a
target of the given shape (random weights) and a random restored head, greedy, prompts of 1,024
tokens (the cost benchmark's context), `speculative_generate` with graphed steps against graphed
target-only `generate`; the measured speed-up set against the one projected from that run's own
acceptance and `verify_cost_<shape>.json`. The prompts' prefill, the same in both loops and
not in the model, is timed alone and taken out of both.

    python -m benchmarks.check_projection --shape smollm2_135m --batch 80 --k 4
    python -m benchmarks.check_projection --shape llama3_8b --batch 1 --k 3 --compiled-layers \
        --costs benchmarks/results/verify_cost_llama3_8b_split_skinny_compiled.json

With --compiled-layers the target's layers run compiled (`CausalLM.compile_layers`: the split-key
attention and the skinny maps, the serving defaults), and the projection should take the step
costs measured that way (`bench_verify_cost --compiled-layers`, given as --costs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.common import DEVICE, DTYPE, RESULTS, shape, timed, write_result
from inference_ref.draft import load_draft
from inference_ref.generate import generate, prefill
from inference_ref.head_spec import HeadSpec
from inference_ref.models import TARGET_KINDS
from inference_ref.skinny_linear import load_block_shapes
from inference_ref.speculative import Chain, speculative_generate
from mtp_train.export import save_head
from mtp_train.heads import MTPHead
from mtp_train.projection import speedup


def random_draft(target, cfg, directory: str):
    frozen = {
        "model.embed_tokens.weight": target.embed_tokens.weight.float().cpu(),
        "model.norm.weight": target.norm.weight.float().cpu(),
        "lm_head.weight": target.lm_head.weight.float().cpu(),
    }
    torch.manual_seed(0)
    head = MTPHead(HeadSpec("rmsnorm-restored", cfg), frozen)
    save_head(head, directory, {"config_hash": cfg.fingerprint()}, {})
    return load_draft(directory, target)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2_135m")
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--compiled-layers", action="store_true", help="the target's layers compiled")
    p.add_argument("--costs", help="the step costs to project with (default: verify_cost_<shape>.json)")
    p.add_argument("--block-shapes", help="the skinny maps' block shapes from this JSON instead of timed")
    args = p.parse_args()
    if args.block_shapes:  # the picks the costs were measured with, so that the two runs agree
        load_block_shapes(args.block_shapes)
    costs_path = Path(args.costs) if args.costs else RESULTS / f"verify_cost_{args.shape}.json"
    costs = json.loads(costs_path.read_text())  # read first: a wrong path fails before the runs
    cfg = shape(args.shape)
    target = TARGET_KINDS[cfg.model_type].random(cfg, DEVICE, DTYPE, 0)
    if args.compiled_layers:
        target.compile_layers()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (1024,), generator=g).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as d:
        draft = random_draft(target, cfg, d)
        no_eos: list[int] = []  # every row runs its full length, as the cost benchmark's do
        # Warm-ups at the measured length: a cache of another length is another shape for the
        # attention kernels' plans (cuDNN builds one per shape) and for compiled code, which the
        # measured call would pay for (bench_decode met this: 1.85 ms a step that was no host work).
        generate(target, prompts, args.new, no_eos)
        speculative_generate(target, draft, prompts, args.new, no_eos, Chain(args.k), graph=True)
        base = timed(lambda: generate(target, prompts, args.new, no_eos))
        # both loops start with the same prefill of every prompt, which the model leaves out;
        # run as the loops run it (in inference mode: a tensor outside it is another input to the
        # compiled layers' guards) and warmed up: on 2026-12-07 the cold call outside inference
        # mode compiled the layers again, 5-7 s timed as the prefill
        cache_len = 1024 + args.new + 2 * args.k + 1
        with torch.inference_mode():
            prefill(target, prompts, cache_len)
            prefill_s = timed(lambda: prefill(target, prompts, cache_len))
        box = []
        spec = timed(
            lambda: box.append(
                speculative_generate(target, draft, prompts, args.new, no_eos, Chain(args.k), graph=True)
            )
        )
    if prefill_s >= min(base, spec):
        raise SystemExit(f"check_projection: the prefill alone ({prefill_s:.3f} s) took longer than a loop")
    stats = box[0].stats
    measured = (base - prefill_s) / (spec - prefill_s)
    projected = speedup(stats.accept_rate, args.k, costs, str(args.batch))
    # (a random head's τ is 1: what is checked is the cost accounting, whatever the acceptance)
    write_result(
        f"projection_check_{args.shape}_b{args.batch}_k{args.k}"
        + ("_compiled" if args.compiled_layers else ""),
        {
            "shape": args.shape,
            "compiled_layers": args.compiled_layers,
            "compiled_layers_ran": target.runs_compiled("cached"),  # false after a fallback
            "costs": costs_path.name,
            "block_shapes_from": args.block_shapes,
            "batch": args.batch,
            "k": args.k,
            "new_tokens": args.new,
            "accept_rate": stats.accept_rate,
            "tau": stats.mean_accepted_len,
            "iterations": stats.iterations,
            "host_ms_per_step": stats.host_ms_per_step,  # the device waits for it (#36: ≤ 0.5 ms)
            "target_only_s": base,
            "speculative_s": spec,
            "prefill_s": prefill_s,
            "measured_speedup_with_prefill": base / spec,
            "measured_speedup": measured,
            "projected_speedup": projected,
            "relative_error": projected / measured - 1,
        },
    )


if __name__ == "__main__":
    main()
