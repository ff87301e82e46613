"""The projection model (`mtp_train.projection`) against a measured wall-clock on the same GPU: a
target of the given shape (random weights) and a random restored head, greedy, prompts of 1,024
tokens (the cost benchmark's context), `speculative_generate` with graphed steps against graphed
target-only `generate`; the measured speed-up set against the one projected from that run's own
acceptance and `verify_cost_<shape>.json`. Both loops run for `--new` and twice as many tokens;
the measured speed-up is the second `--new` tokens', so that what a call pays once (the prompts'
prefill, the same in both loops and not in the model, and the capture of each loop's graphs)
cancels; those tokens attend over 1,152-1,280 cached tokens where the costs' verifies attend over
1,024, a small bias toward a lower measured speed-up. `--head eagle3` drafts with a random EAGLE-3
head instead (its fc over three captured target states, its 2H-input layer and, at a vocabulary of
100k or more, its default 32,000-row draft vocabulary), projected with the costs' draft step of that
vocabulary (`draft_step_ms_by_vocab`) where they have one: the check of that part of the model.
On a GPU the loop's graphed step is also replayed alone (`loop_step`) and set against the
projection's step (a verify of k + 1 tokens and k draft steps): what of the error is GPU work in the
step and what is the loop's host work around it; `--profile` adds the step's GPU time by kernel kind.

    python -m benchmarks.check_projection --shape smollm2_135m --batch 80 --k 4
    python -m benchmarks.check_projection --shape llama3_8b --batch 1 --k 3 --compiled-layers \
        --costs benchmarks/results/verify_cost_llama3_8b_split_skinny_compiled.json [--head eagle3]

With --compiled-layers the target's layers run compiled (`CausalLM.compile_layers`: the split-key
attention and the skinny maps, the serving defaults), and the projection should take the step
costs measured that way (`bench_verify_cost --compiled-layers`, given as --costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.bench_verify_cost import replay_ms, replayed_profile
from benchmarks.common import DEVICE, DTYPE, RESULTS, shape, timed, write_result
from benchmarks.random_draft import head_spec, random_draft
from inference_ref.generate import generate, last_logits, prefill
from inference_ref.models import TARGET_KINDS
from inference_ref.skinny_linear import IN_GRAPHS, load_block_shapes, use_linear_kernel
from inference_ref.speculative import NO_CLOCK, Chain, SpecStep, draft_prefill, speculative_generate
from mtp_train.projection import chain_step_ms, speedup

TIMED_REPLAYS, PROFILED_REPLAYS = 20, 5  # of the loop's step by `loop_step`, after one to warm up


def replays(profile: bool) -> int:
    """The loop's step replayed by `loop_step` (its capture's warm-up restores the lengths)."""
    return 1 + TIMED_REPLAYS + (PROFILED_REPLAYS if profile else 0)


@torch.inference_mode()
def loop_step(target, draft, prompts: list[list[int]], k: int, new: int, profile: bool) -> dict:
    """The loop's graphed step alone (`SpecStep`, as `speculative_generate` builds it after the
    prefill): ms a replay, so that the loop's host work and its GPU step are told apart; with
    `profile`, the step's GPU time by kernel kind and its top kernels (what the projection's verify
    and draft steps leave out shows there). The cache is the loop's (the same attention spans), so
    the replays, each committing up to k + 1 tokens a row, must fit in `new` (`main` checks)."""
    max_len = len(prompts[0]) + new + Chain(k).cache_room
    target_cache, hidden = prefill(target, prompts, max_len, draft.capture)
    last = last_logits(target, hidden, target_cache.lengths).argmax(-1)
    draft_cache, y = draft_prefill(draft, hidden, prompts, last, max_len)
    step = SpecStep(target, draft, target_cache, draft_cache, k, 0.0, None, NO_CLOCK, graph=True)
    step.start(last, y, torch.ones(len(prompts), dtype=torch.bool, device=last.device))
    step.cuda_graph.replay()  # the first replay's own costs are not the step's
    if profile:  # PROFILED_REPLAYS profiled, then TIMED_REPLAYS timed
        return replayed_profile(step.cuda_graph, repeats=PROFILED_REPLAYS)
    return {"step_ms": replay_ms(step.cuda_graph, repeats=TIMED_REPLAYS)}


LOOP_REPEATS = 3  # timings of each loop at each length, in turn; the medians are taken


def timed_loops(target, draft, prompts: list[list[int]], k: int, short: int) -> tuple[dict, object]:
    """Target-only `generate` and graphed `speculative_generate` (a chain of k) for `short` and
    2 · `short` new tokens, each warmed up at its own length first (a cache of another length is
    another shape for the attention kernels' plans, which cuDNN builds per shape, and for compiled
    code: bench_decode met 1.85 ms a step that was no host work), then timed `LOOP_REPEATS` times
    in turn. Returns each loop's median seconds at `short` and the median of its second `short`
    tokens (the longer call less the shorter, per repeat: every fixed cost of a call cancels: the
    prefills, the graphs' capture, a one-off such as run 15's 60 ms in one target-only call), and
    the longer speculative run's stats."""
    no_eos: list[int] = []  # every row runs its full length, as the cost benchmark's do
    lengths, spec_runs = (short, 2 * short), {}

    def target_only(n: int) -> None:
        generate(target, prompts, n, no_eos)

    def speculative(n: int) -> None:
        spec_runs[n] = speculative_generate(target, draft, prompts, n, no_eos, Chain(k), graph=True)

    loops = {"target_only": target_only, "speculative": speculative}
    for n in lengths:
        for run in loops.values():
            run(n)
    times = {(name, n): [] for name in loops for n in lengths}
    for _ in range(LOOP_REPEATS):
        for n in lengths:
            for name, run in loops.items():
                times[name, n].append(timed(lambda run=run, n=n: run(n)))
    seconds = {}
    for name in loops:
        at_short, at_long = times[name, short], times[name, 2 * short]
        seconds[name] = statistics.median(at_short)
        seconds[f"{name}_second_half"] = statistics.median(b - a for a, b in zip(at_short, at_long))
        seconds[f"{name}_fixed"] = statistics.median(2 * a - b for a, b in zip(at_short, at_long))
    return seconds, spec_runs[2 * short].stats


def timed_prefill(target, prompts: list[list[int]], k: int, new: int) -> float:
    """Seconds of the prompts' prefill alone, run as the loops run it (in inference mode: a tensor
    outside it is another input to the compiled layers' guards) and warmed up: on 2026-12-07 the
    cold call outside inference mode compiled the layers again, 5-7 s timed as the prefill."""
    cache_len = len(prompts[0]) + new + Chain(k).cache_room
    with torch.inference_mode():
        prefill(target, prompts, cache_len)
        return timed(lambda: prefill(target, prompts, cache_len))


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2_135m")
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--compiled-layers", action="store_true", help="the target's layers compiled")
    p.add_argument("--costs", help="the step costs to project with (default: verify_cost_<shape>.json)")
    p.add_argument("--block-shapes", help="the skinny maps' block shapes from this JSON instead of timed")
    p.add_argument("--head", default="rmsnorm-restored", choices=("rmsnorm-restored", "eagle3"))
    p.add_argument("--profile", action="store_true", help="also the loop's step by kernel kind")
    p.add_argument(
        "--skinny-in-graphs",
        action=argparse.BooleanOptionalAction,
        default=IN_GRAPHS,
        help="the graphed step's eager maps (the draft's layer and lm_head) through the skinny kernels "
        "(use_linear_kernel's in_graphs); on: _in_graphs added to the file name",
    )
    return p.parse_args()


def read_costs(args: argparse.Namespace) -> tuple[Path, dict]:
    """The step costs, checked before any run: the batch and the verify of k + 1 tokens in them,
    and room in `--new` for `loop_step`'s replays where they run."""
    path = Path(args.costs) if args.costs else RESULTS / f"verify_cost_{args.shape}.json"
    costs = json.loads(path.read_text())
    verify = costs["verify_ms"].get(str(args.batch))
    if verify is None or str(args.k + 1) not in verify:
        raise SystemExit(
            f"check_projection: {path} has no verify_ms for batch {args.batch}, {args.k + 1} tokens"
        )
    if DEVICE == "cuda" and replays(args.profile) * (args.k + 1) > args.new:
        raise SystemExit(
            f"check_projection: --new {args.new} leaves no room for {replays(args.profile)} steps of k + 1 tokens"
        )
    return path, costs


def main() -> None:
    args = arguments()
    if args.block_shapes:  # the picks the costs were measured with, so that the two runs agree
        load_block_shapes(args.block_shapes)
    use_linear_kernel("auto", in_graphs=args.skinny_in_graphs)
    costs_path, costs = read_costs(args)
    cfg = shape(args.shape)
    head = head_spec(args.head, cfg)
    target = TARGET_KINDS[cfg.model_type].random(cfg, DEVICE, DTYPE, 0)
    if args.compiled_layers:
        target.compile_layers()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (1024,), generator=g).tolist() for _ in range(args.batch)]
    draft = random_draft(target, head)
    seconds, stats = timed_loops(target, draft, prompts, args.k, args.new)
    prefill_s = timed_prefill(target, prompts, args.k, args.new)
    if prefill_s >= min(seconds["target_only"], seconds["speculative"]):
        raise SystemExit(f"check_projection: the prefill alone ({prefill_s:.3f} s) took longer than a loop")
    # (a CUDA graph: on a CPU smoke run there is no step to replay)
    step = loop_step(target, draft, prompts, args.k, args.new, args.profile) if DEVICE == "cuda" else None
    # the second `new` tokens: run 14 (2026-12-07, an H100) found each call's fixed costs 56-143
    # ms, which at one length read as 0.4-1.1 ms a step
    measured = seconds["target_only_second_half"] / seconds["speculative_second_half"]
    b, vocab = str(args.batch), head.draft_vocab_size or None
    projected = speedup(stats.accept_rate, args.k, costs, b, vocab=vocab)
    projected_step = chain_step_ms(costs, b, args.k, vocab=vocab)  # the step `speedup` divides by
    # (a random head's τ is 1: what is checked is the cost accounting, whatever the acceptance)
    write_result(
        f"projection_check_{args.shape}_b{args.batch}_k{args.k}"
        + ("_compiled" if args.compiled_layers else "")
        + ("" if args.head == "rmsnorm-restored" else f"_{args.head}")
        + ("_in_graphs" if args.skinny_in_graphs else ""),
        {
            "shape": args.shape,
            "compiled_layers": args.compiled_layers,
            "compiled_layers_ran": target.runs_compiled("cached"),  # false after a fallback
            "costs": costs_path.name,
            "block_shapes_from": args.block_shapes,
            "skinny_in_graphs": args.skinny_in_graphs,
            "head": args.head,
            "draft_vocab_size": head.draft_vocab_size,  # 0: the whole vocabulary
            "draft_step_ms_by_vocab_measured": str(vocab) in costs.get("draft_step_ms_by_vocab", {}),
            "batch": args.batch,
            "k": args.k,
            "new_tokens": args.new,
            "loop_repeats": LOOP_REPEATS,
            "accept_rate": stats.accept_rate,
            "tau": stats.mean_accepted_len,
            "iterations": stats.iterations,
            "host_ms_per_step": stats.host_ms_per_step,  # the device waits for it (#36: ≤ 0.5 ms)
            "seconds": seconds,  # medians: at --new, its second --new tokens, each call's fixed cost
            "prefill_s": prefill_s,
            # at one length less the prefill alone (runs 12-14 reported this one)
            "measured_speedup_one_length": (seconds["target_only"] - prefill_s)
            / (seconds["speculative"] - prefill_s),
            "measured_speedup": measured,
            "projected_speedup": projected,
            "relative_error": projected / measured - 1,
            # the graphed step replayed alone, against the projection's step: the share of the
            # error that is GPU work in the step, not the loop's host work around it
            "loop_step": step,
            "projected_step_ms": projected_step,
            "step_relative_error": projected_step / step["step_ms"] - 1 if step else None,
        },
    )


if __name__ == "__main__":
    main()
