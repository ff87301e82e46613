"""What a speculative step costs the target and the draft, per target shape: the verify forward of
n new tokens per row (n = 1 is plain decoding) at several batch sizes over a filled KV cache, and
one draft step, each as a replayed CUDA graph (what serving engines run). Validation combines these
with a head's measured acceptance into projected speed-ups (`mtp_train.projection`).

    python -m benchmarks.bench_verify_cost --shape llama3_8b
    python -m benchmarks.bench_verify_cost --shape llama3_70b --layers 8 16
    python -m benchmarks.bench_verify_cost --shape llama3_8b --cached-kernel flex   # FlexAttention
    python -m benchmarks.bench_verify_cost --shape llama3_8b --compiled-layers      # compiled layers
    python -m benchmarks.bench_verify_cost --shape llama3_8b --cached-kernel mixed --compiled-layers
                                        # SDPA decodes, flex verifies: the default before "split"
    python -m benchmarks.bench_verify_cost --shape llama3_8b --compiled-layers --autotune --batches 1 8
    python -m benchmarks.bench_verify_cost --shape llama3_8b --compiled-layers --cached-kernel split \
        --linear-kernel skinny       # the Triton kernels: split-key attention, the skinny linear map
                                     # (with the layer's norms, rotary, cache writes, adds folded in;
                                     # --unfolded: the maps alone)

A shape too large for one GPU is measured with fewer layers, twice (`--layers A B`), and the full
depth extrapolated linearly: cost(L) = cost(A) + (L − A) · (cost(B) − cost(A)) / (B − A); the
embedding and lm_head are in both, so only the layers scale.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import torch

from benchmarks.common import (
    DEVICE,
    DTYPE,
    decode_read_bytes,
    inductor_autotune,
    kernel_profile,
    peak_bandwidth,
    shape,
    strict_compile,
    write_result,
)
from benchmarks.random_draft import head_spec, random_draft
from inference_ref.attention import CACHED_KERNELS, use_cached_kernel
from inference_ref.decode_graph import record
from inference_ref.head_spec import HEAD_KINDS
from inference_ref.models import TARGET_KINDS
from inference_ref.skinny_linear import (
    IN_GRAPHS,
    LINEAR_KERNELS,
    graphed_eager_maps,
    load_block_shapes,
    tuned_configs,
    use_linear_kernel,
)
from inference_ref.triton_support import use_pdl

BATCHES = (1, 8, 32, 64)
NEW_TOKENS = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64)
CONTEXT = 1024  # committed tokens per row before the verify: a mid-conversation cache


def captured(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured as a CUDA graph (after two eager warm-ups on a side stream) and replayed once."""
    graph, _ = record(fn)
    graph.replay()
    return graph


def graphed(fn, repeats: int = 20) -> float:
    """Milliseconds per replay of `fn` captured as a CUDA graph."""
    return replay_ms(captured(fn), repeats)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    """Milliseconds per replay of a captured graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@torch.inference_mode()
def verify_costs(model, batches, new_tokens, context: int = CONTEXT) -> dict[str, dict[str, float]]:
    """ms of one verify forward (all positions' logits) per (batch, new tokens), after `context`
    committed tokens per row."""
    out = {}
    for b in batches:
        cache = model.new_cache(b, context + max(new_tokens) + 1)
        cache.lengths.fill_(context)
        out[str(b)] = {}
        for n in new_tokens:
            ids = torch.randint(0, model.cfg.vocab_size, (b, n), device=DEVICE)

            def verify(ids=ids, cache=cache):
                model.logits(model.forward_cached(ids, cache, static=True))

            out[str(b)][str(n)] = graphed(verify)
        del cache
        torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def draft_steps(draft, batches, context: int = CONTEXT):
    """Per batch, (batch, one draft step) of `draft` (a random head loaded as serving loads it,
    `benchmarks.random_draft`), chained one token a row from the previous step's state over
    `context` committed entries: its layer (an EAGLE-3 head's reads [e; g], 2H, and runs no fc
    when chained), its logits over the target vocabulary (its draft vocabulary's rows, if any,
    scattered) and the argmax the loop drafts the token with."""
    cfg = draft.spec.target
    for b in batches:
        cache = draft.new_cache(b, context + 8)
        cache.lengths.fill_(context)
        y = torch.randn(b, cfg.hidden_size, device=DEVICE, dtype=DTYPE)
        token = torch.randint(0, cfg.vocab_size, (b,), device=DEVICE)

        def step(y=y, token=token, cache=cache):
            return draft.logits(draft.chain(y, token, cache, 1, static=True)).argmax(-1)

        yield b, step


def eagle3_draft_vocab(cfg) -> int:
    """The draft vocabulary an EAGLE-3 head on this target has by default (0: the whole one, or
    no EAGLE-3 head for this target kind)."""
    kind = HEAD_KINDS["eagle3"]
    fits = kind.target_kinds is None or cfg.model_type in kind.target_kinds
    return kind.default_draft_vocab(cfg.vocab_size) if fits else 0


@torch.inference_mode()
def draft_figures(model, batches, context: int, profile: bool) -> dict:
    """The draft step's costs, ms per batch: a restored head's (the whole vocabulary's lm_head)
    and, where this target's EAGLE-3 head has a draft vocabulary by default, that head's by its
    vocabulary (32,000 rows on targets of >= 100k tokens: the whole vocabulary's lm_head was 61 %
    of a batch-1 draft step at 8B, run 13's profile); with `profile`, the restored head's step
    profiled (its ms, GPU ms by kernel kind and top kernels, totals over 10 replays). The drafts
    run eager, as the loop runs them; `main` times them under the default kernels ("auto": cuBLAS
    maps and SDPA outside compiled layers), whatever the target's were (run 15 timed them under
    the target's skinny maps)."""

    def step_ms(draft) -> dict[str, float]:
        return {str(b): graphed(step) for b, step in draft_steps(draft, batches, context)}

    restored = random_draft(model, head_spec("rmsnorm-restored", model.cfg))
    vocab = eagle3_draft_vocab(model.cfg)
    return {
        "draft_step_kind": "a random head's chained step, eager, the default kernels (since 2026-12-07)"
        + (", its maps skinny in the graph (in_graphs)" if graphed_eager_maps() else ""),
        "draft_step_ms": step_ms(restored),
        "draft_step_ms_by_vocab": {str(vocab): step_ms(random_draft(model, head_spec("eagle3", model.cfg)))}
        if vocab
        else {},
        "draft_profile": {
            str(b): replayed_profile(captured(step), 10)
            for b, step in draft_steps(restored, batches, context)
        }
        if profile
        else None,
    }


def use_kernels(args: argparse.Namespace) -> None:
    """The linear and cached-attention kernels the command line asks for."""
    use_cached_kernel(args.cached_kernel)
    use_linear_kernel(
        args.linear_kernel,
        folds=not args.unfolded,
        tile_activation=args.tile_activation,
        tile_norm=args.tile_norm,
    )


@contextmanager
def default_kernels(args: argparse.Namespace):
    """The linear and cached-attention kernels at their defaults ("auto") for a while, as the loop
    runs its eager draft; then the command line's again."""
    use_cached_kernel("auto")
    use_linear_kernel("auto", in_graphs=args.skinny_in_graphs)
    try:
        yield
    finally:
        use_kernels(args)


def replayed_profile(graph: torch.cuda.CUDAGraph, repeats: int = 10) -> dict:
    """A captured step replayed `repeats` times: its wall ms, GPU ms per step by kernel kind, the
    busy total and kernels per step, and the top kernels (their ms totals over the replays)."""
    profiled = kernel_profile(lambda: [graph.replay() for _ in range(repeats)])
    return {
        "step_ms": replay_ms(graph),
        "gpu_busy_ms": profiled["gpu_busy_ms"] / repeats,
        "ms_by_kind": {kind: ms / repeats for kind, ms in profiled["ms_by_kind"].items()},
        "kernels_per_step": profiled["kernel_calls"] / repeats,
        "top_kernels": profiled["top_kernels"],
    }


PROFILED_NEW_TOKENS = (1, 8)  # a decode step, and the verify of 8 tokens #36 holds against it


@torch.inference_mode()
def decode_profiles(model, batches, device_name: str, context: int = CONTEXT, repeats: int = 10) -> dict:
    """Where a replayed decode or verify step's time goes, per batch and new tokens per row
    (`PROFILED_NEW_TOKENS`): GPU ms per step by kernel kind, the step's wall ms, and the matmuls' own
    read rate over the linear weights they stream (#36's 75 % at batch 1: is the step's excess over
    the weight-read limit inside the GEMVs or between them? and its 1.1× verify: which kind grows?)."""
    weights = sum(
        m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    bandwidth = peak_bandwidth(device_name)
    out = {}
    for b in batches:
        cache = model.new_cache(b, context + max(PROFILED_NEW_TOKENS) + 1)
        cache.lengths.fill_(context)
        out[str(b)] = {}
        for n in PROFILED_NEW_TOKENS:
            ids = torch.randint(0, model.cfg.vocab_size, (b, n), device=DEVICE)
            graph = captured(
                lambda ids=ids, cache=cache: model.logits(model.forward_cached(ids, cache, static=True))
            )
            profiled = replayed_profile(graph, repeats)
            matmul_s = profiled["ms_by_kind"].get("matmul", 0.0) / 1e3
            read_rate = weights / matmul_s if matmul_s else None
            out[str(b)][str(n)] = {
                **profiled,
                "linear_weight_bytes": weights,
                "matmul_read_bytes_per_s": read_rate,
                "matmul_share_of_peak": read_rate / bandwidth if read_rate and bandwidth else None,
            }
            del graph
        del cache
        torch.cuda.empty_cache()
    return out


def decode_read_limits(cfg, verify: dict, device_name: str, context: int = CONTEXT) -> dict | None:
    """Per batch, the bytes a decode step must read (`common.decode_read_bytes`), the ms that takes
    at the device's peak bandwidth, and the measured decode step's share of that peak (#36: 75 % at
    batch 1). None where the kind or the device has no such count."""
    bandwidth = peak_bandwidth(device_name)
    reads = {bs: decode_read_bytes(cfg, int(bs), context) for bs in verify}
    if bandwidth is None or None in reads.values():
        return None
    limits = {bs: read / bandwidth * 1e3 for bs, read in reads.items()}
    return {
        bs: {"bytes": reads[bs], "limit_ms": limits[bs], "share_of_peak": limits[bs] / row["1"]}
        for bs, row in verify.items()
    }


def main(argv: list[str] | None = None, command: str | None = None) -> None:
    """argv: the arguments (sys.argv's by default); command: the command line the JSON records."""
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3_8b")
    p.add_argument("--layers", type=int, nargs=2, default=None, help="measure at two depths, extrapolate")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument(
        "--cached-kernel",
        choices=CACHED_KERNELS,
        default="sdpa",
        help="the cached attention's kernel (inference_ref.attention.use_cached_kernel); "
        "not sdpa: written to verify_cost_<shape>_<kernel>.json beside sdpa's (the library's own default, auto, "
        "runs split in compiled layers on CUDA, mixed for token trees)",
    )
    p.add_argument(
        "--linear-kernel",
        choices=LINEAR_KERNELS,
        default="cublas",
        help="the layers' linear maps (inference_ref.skinny_linear.use_linear_kernel); "
        "not cublas: _<kernel> added to the file name (the library's own default, auto, runs skinny in "
        "compiled layers)",
    )
    p.add_argument(
        "--unfolded",
        action="store_true",
        help="with --linear-kernel skinny: the maps alone, the layer's norms, rotary, cache writes, "
        "SiLU·up and residual adds in the compiled layer's own kernels (use_linear_kernel's folds=False); "
        "_unfolded added to the file name",
    )
    p.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one row's Triton kernels launched with programmatic dependent launch on Hopper "
        "(inference_ref.triton_support.use_pdl, the default); --no-pdl: _no_pdl added to the file name",
    )
    p.add_argument(
        "--pdl-tiles",
        action="store_true",
        help="with --pdl: the Triton kernels over 2-64 rows (a verify's tiles) with PDL too, each "
        "loading its first weights before the wait (use_pdl's tiles, off by default: run 11 measured no "
        "gain); "
        "_pdl_tiles added to the file name",
    )
    p.add_argument("--tag", default="", help="added to the file name (a partial grid, another device)")
    p.add_argument(
        "--tile-activation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a tile's SiLU·up in gate_up's epilogue (use_linear_kernel's tile_activation, on by default "
        "since run 11), not in the compiled layer's own kernel; --no-tile-activation adds "
        "_no_tile_activation to the file name (before 2026-12-07 the default was off and "
        "_tile_activation named the runs with it on)",
    )
    p.add_argument(
        "--tile-norm",
        action="store_true",
        help="a tile's RMSNorms split between the maps before and after them (o_proj and gate_up; "
        "down_proj and the next layer's q|k|v: use_linear_kernel's tile_norm, off by default: run 11 "
        "measured no gain), not in the compiled layer's own kernels; _tile_norm added to the file name",
    )
    p.add_argument(
        "--skinny-in-graphs",
        action=argparse.BooleanOptionalAction,
        default=IN_GRAPHS,
        help="the draft step's eager maps (its layer's and lm_head) through the skinny kernels in the "
        "captured step (use_linear_kernel's in_graphs); on: _in_graphs added to the file name",
    )
    p.add_argument(
        "--block-shapes",
        help="the skinny maps' block shapes from an earlier run's JSON (its skinny_configs) instead of "
        "timing them (inference_ref.skinny_linear.load_block_shapes): the same kernels in every process",
    )
    p.add_argument("--new-tokens", type=int, nargs="+", default=list(NEW_TOKENS), help="per row, 1 = decode")
    p.add_argument("--context", type=int, default=CONTEXT, help="committed tokens per row before the step")
    p.add_argument(
        "--compiled-layers",
        action="store_true",
        help="the target's layers through torch.compile (CausalLM.compile_layers), as regeneration and "
        "decoding can run them; written to verify_cost_<shape>[_<kernel>]_compiled.json",
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="with --compiled-layers: Inductor's GEMM and coordinate-descent autotuning "
        "(benchmarks.common.inductor_autotune); written to verify_cost_<shape>[_<kernel>]_compiled_autotuned.json",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile each batch's replayed decode step and 8-token verify by kernel kind "
        "(`decode_profile` in the JSON, by batch, then new tokens); "
        "written to verify_cost_<shape>[...]_profiled.json",
    )
    args = p.parse_args(argv)
    if args.block_shapes:
        load_block_shapes(args.block_shapes)
    if args.autotune and not args.compiled_layers:
        p.error("--autotune tunes the compiled layers: add --compiled-layers")
    if args.profile and args.layers:
        p.error("--profile profiles the full depth: drop --layers")
    strict_compile()
    if args.autotune:
        inductor_autotune()
    use_kernels(args)
    use_pdl(args.pdl, args.pdl_tiles)
    cfg = shape(args.shape)
    depths = args.layers or [cfg.num_hidden_layers]
    measured, profiles = {}, None
    for depth in depths:
        part = type(cfg)(**{**cfg.__dict__, "num_hidden_layers": depth})
        model = TARGET_KINDS[cfg.model_type].random(part, DEVICE, DTYPE, 0)
        if args.compiled_layers:
            model.compile_layers()
        measured[depth] = verify_costs(model, args.batches, args.new_tokens, args.context)
        if args.profile:
            profiles = decode_profiles(model, args.batches, torch.cuda.get_device_name(), args.context)
        # the draft steps on the last depth's model (a draft is one layer and the target's lm_head)
        if depth == depths[-1]:
            with default_kernels(args):
                drafts = draft_figures(model, args.batches, args.context, args.profile)
        ran_compiled = model.runs_compiled("cached")  # false too where the compile fell back to eager
        del model
        torch.cuda.empty_cache()
    if len(depths) == 2:
        a, b = depths
        full = cfg.num_hidden_layers
        verify = {
            bs: {
                n: measured[a][bs][n] + (full - a) * (measured[b][bs][n] - measured[a][bs][n]) / (b - a)
                for n in row
            }
            for bs, row in measured[a].items()
        }
    else:
        verify = measured[depths[0]]
    device_name = torch.cuda.get_device_name()
    suffix = (
        ("" if args.cached_kernel == "sdpa" else f"_{args.cached_kernel}")
        + ("" if args.linear_kernel == "cublas" else f"_{args.linear_kernel}")
        + ("_unfolded" if args.unfolded else "")
        + ("" if args.tile_activation else "_no_tile_activation")
        + ("_tile_norm" if args.tile_norm else "")
        + ("" if args.pdl else "_no_pdl")
        + ("_pdl_tiles" if args.pdl and args.pdl_tiles else "")
        + ("_compiled" if args.compiled_layers else "")
        + ("_autotuned" if args.autotune else "")
        + ("_in_graphs" if args.skinny_in_graphs else "")
        + ("_profiled" if args.profile else "")  # its own file: a profiled run times fewer batches
        + (f"_{args.tag}" if args.tag else "")
    )
    write_result(
        f"verify_cost_{args.shape}{suffix}",
        {
            "command": command
            or "python -m benchmarks.bench_verify_cost " + " ".join(sys.argv[1:] if argv is None else argv),
            "shape": args.shape,
            "cached_kernel": args.cached_kernel,
            "linear_kernel": args.linear_kernel,
            "folded": not args.unfolded,
            "tile_activation": args.tile_activation,
            "tile_norm": args.tile_norm,
            "pdl": args.pdl,
            "pdl_tiles": args.pdl and args.pdl_tiles,
            "skinny_in_graphs": args.skinny_in_graphs,
            "skinny_configs": tuned_configs(),
            "block_shapes_from": args.block_shapes,
            "compiled_layers": args.compiled_layers,
            "autotune": args.autotune,
            "compiled_layers_ran": ran_compiled,
            "context_tokens": args.context,
            "measured_layers": depths,
            "layers": cfg.num_hidden_layers,  # the shape's (what mtp_train.projection costs a layer by)
            "extrapolated": len(depths) == 2,
            "verify_ms": verify,
            "verify_ms_measured": {str(d): m for d, m in measured.items()} if len(depths) == 2 else None,
            **drafts,
            "peak_bandwidth_bytes_per_s": peak_bandwidth(device_name),
            "decode_read": decode_read_limits(cfg, verify, device_name, args.context),
            "decode_profile": profiles,
        },
    )


if __name__ == "__main__":
    main()
