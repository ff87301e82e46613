#!/usr/bin/env bash
# Issue #36's GPU measurements in one background run on one H200 (the first items, through spec_b8,
# took 8.5 minutes on 2026-12-05; the full list is longer than one device session). Run it from a copy
# of the repository outside the synced working tree (each call re-syncs that tree, and the tracked
# JSONs under benchmarks/results/ would overwrite what a finished benchmark wrote there):
#   mkdir -p /root/repo && tar cf - --exclude=.devcache . | tar xf - -C /root/repo
#   cd /root/repo && setsid nohup bash benchmarks/speed_run.sh /root/speed > /root/speed.log 2>&1 < /dev/null &
# with the wheels the image lacks carried along (`carry: [".whl"]`, ../shared/gpu/wheels.sh: hydra,
# deepspeed; without them check_projection and the DeepSpeed check fail on import). The tracked
# tree and .whl together pass the 64 MiB a call carries: copy the four wheels the benchmarks import
# (hydra_core, omegaconf, antlr4, dill) into .devcache/whl, carry that, copy it to /root/whl and
# set WHEELS=/root/whl (the copy above leaves .devcache out),
# then poll from back-to-back calls (the machine goes back 30 s after a call ends, with the run):
#   bash /root/repo/benchmarks/speed_poll.sh 540
# SKIP="t k_split_skinny ..." leaves those items out (what an earlier run on the same kind of GPU measured);
# ONLY="..." runs those items alone.
# Each finished benchmark's JSON is copied into $log/results/ at once, so that whatever finished
# comes back in the next poll.
# First what #36 still needs, so that a short device budget gets it. After the 2026-12-05 runs the
# kernels meet every verify and decode bar on an H100 at both shapes. The H200 is short: decode at
# batch 1 reads at 72.4 % (75 % asked), and 6-8-token verifies at batch 8 cost 1.10-1.17x (1.1x).
# Since its last H200 run the skinny maps take the layer's work around them (2026-12-05, third
# session): the RMSNorms in the loads of q|k|v and gate_up, q|k|v's rotary and cache writes in its
# epilogue (`qkv_rope_cache`), the residual adds in o_proj's and down_proj's: 6 kernels a layer
# instead of run 2's 12 at batch 1. Run 4 measured that on an H100 (8B decode at batch 1: 83.0 %
# of the read limit, verifies 1.01-1.10x), and run 5 again on an H100 (2026-12-06, the GPU tests
# passed). Run 6 (2026-12-06, an H200 at last, 8.6 minutes for the items below but t, g,
# k_mixed_skinny and the unfolded ones): 8B verifies within 1.1x, decode at batch 1 74.0 % (75.1 %
# with the block shapes added after it), 70B verifies at batch 8 of 6-8 tokens 1.14-1.20x (run 6).
# Run 7 (2026-12-06, fifth session, an H100): the PDL A/B below and `t` (passed); PDL now on by
# default. Run 8 (2026-12-06, sixth session, an H100): 2-8 rows without tl.dot, 1.06-2.9x slower
# than the tiles, taken back (docs/benchmarks.md). Run 10 (2026-12-06, seventh session, an H200):
# split K's A/B at 70B (never chosen: taken out), o8_* (PDL there), t (passed), p, k70_split_skinny,
# decode64, spec_b*, k_split_skinny. Next, built after run 10 and not yet run on a GPU (docs/benchmarks.md,
# "After run 10"): ta_* (silu_gate_up's A/B), bp* (block shapes given), kp* (the projection with the
# kernels' step costs); and after the eighth session (no GPU came), pt_* (PDL for the tiles), tn_*
# (a tile's norms split between the maps around them), ab_* (the three at once: run it first).
# Run 11 (2026-12-07, an H100): ab_* and ta_*: SiLU·up in gate_up's epilogue pays and is on by
# default; the tiles' PDL and the split norms do not (off). Next: ta_* on an H200 with BLOCK_SHAPES,
# then t, kp*, bp*, and p p_all (where all three together lose).
# Run 12 (2026-12-07, twelfth session, an H100 again): ta_* with BLOCK_SHAPES=..._h100.json (the
# default's batch-1 verifies 1.076-1.091x), t (passed), kp* (the projection with the kernels'
# costs: -0.5 %, +6.3 %), p, p_all, k70_split_skinny, decode64. Next, on an H200: ta_*, then bp*,
# p (now with the draft step's profile: two draft steps cost 3.5x what a verify adds at batch 1),
# kp* and k70_split_skinny (now with 3 and 5 tokens, for the 70B projection's k = 2 and 4).
# Run 13 (2026-12-07, thirteenth session, two H100s, no H200): p (the draft step profiled: the
# whole vocabulary's lm_head is 61 % of it), then kp kp_b1 kp_b8 with BLOCK_SHAPES (kp now also
# measures eagle3's 32,000-row draft step: 0.346 ms against 0.659). Next, on an H200: as run 12 says.
# Runs 14 and 15 (2026-12-07, fourteenth session, two H100s, no H200): kp kp_b1 kp_b8 kp_e3_b1
# kp_e3_b8 (the projection checked with an EAGLE-3 head; the loop's step replayed alone; run 15 with
# the real draft's step). Since: the drafts timed under the default kernels, loop_step's warm replay,
# the loops timed three times in turn. Next, on an H200: ta_*, then kp*, bp*, p, k70_split_skinny;
# on any GPU: kp kp_b1 kp_b8 kp_e3_b1 kp_e3_b8 again (the fixes, not yet run).
# Run 16 (2026-12-07, sixteenth session, an H100, no H200): kp kp_b1 kp_b8 kp_e3_b1 kp_e3_b8 with
# the fixes: the projection within 2.3 % of the loop. Next, on an H200: ta_*, then bp*, p,
# k70_split_skinny.
# Since run 16 (2026-12-08, seventeenth session): ig_* (the graphed draft's maps through the skinny
# kernels, use_linear_kernel's in_graphs) for an A/B on any GPU: ONLY="kp_b1 ig_b1 kp_e3_b1 ig_e3_b1"
# (on an H100 with KP_COSTS=benchmarks/results/verify_cost_llama3_8b_split_skinny_compiled_projection_h100_run16.json).
# Run on an H200 (with `kind: nvidia-h200`; name the file suffix; stop at once when
# nvidia-smi names another GPU when only an H200 will do):
#   t    the Triton kernels' GPU tests (bf16 against PyTorch's, every block shape forced,
#        compiled target steps; more than 4 minutes since block_shapes forces about 55 shapes,
#        each compiled; passed on an H100 in run 5, and on 2026-12-06 up to the compiled steps,
#        which the call's limit cut);
#   k*   whole decode and verify steps at the 8B shape, batches 1 and 8, with the kernels (split-key
#        attention, the skinny linear map with the layer folded in: the default), with the maps
#        alone (--unfolded), and mixed attention with cuBLAS, one after another on the same machine;
#   p    the decode step and the 8-token verify with the kernels, profiled by kernel kind (and
#        p_unfolded: the maps alone, for the folded kernels' own times against the ones they replace);
#   k70* the same at the 70B shape (8 and 16 layers, extrapolated);
#   g    each map alone: cuBLAS, Inductor's reduction, the skinny kernel;
#   decode64  decoding at batch 64 against HF generate with the new defaults (#36: >= 10x);
#   k_mixed_skinny  flex verifies with the skinny maps;
#   spec_b*  the speculative loop against its projection;
#   k64*, p64*  decode and 2-4-token verifies at batches 16-64 over decode64's cache length, with the
#        kernels, with cuBLAS maps, and mixed attention with cuBLAS; batch 64's step profiled by kernel kind.
# Then the full rerun:
#   1-3  whole verify steps at the 8B shape, compiled layers: the previous default (mixed: SDPA decodes,
#        flex verifies), flex and SDPA alone, one after another on the same machine;
#   4    the 70B shape, 8 and 16 layers extrapolated, batches 1 and 8 (#36's bar is batches 1-8);
#   5    Inductor's GEMM and coordinate-descent autotuning, batches 1 and 8;
#   6    the graphed speculative loop against the projection at batches 1 and 8, with the host's
#        work between steps (`host_ms_per_step`; #36: <= 0.5 ms);
#   7    FP8 precompute against bf16 (#36: 1.6x);
#   8    the GPU tests, the FP8 load's peak memory among them.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-/root/speed}
mkdir -p "$log/results"
wheels=${WHEELS:-.whl}  # WHEELS=/root/whl: the four wheels the benchmarks import (see the header)
if ls "$wheels"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
touch "$log/started"
run() {
    local name=$1; shift
    case " ${SKIP:-} " in *" $name "*) echo "== skip $name"; return;; esac
    if [ -n "${ONLY:-}" ]; then case " $ONLY " in *" $name "*) ;; *) return;; esac; fi
    echo "== $(date +%T) $name: $*"
    if "$@" > "$log/$name.log" 2>&1; then echo "   $(date +%T) done"; else echo "   $(date +%T) FAILED (see $log/$name.log)"; fi
    find benchmarks/results -name '*.json' -newer "$log/started" -exec cp -p {} "$log/results/" \;
}
v="python -m benchmarks.bench_verify_cost"
# what #36 still needs first (see above), then the full rerun
k="$v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 2 3 4 6 8 --tag kernels"
# split K for the maps' row tiles (2026-12-06): taken out after run 10 on an H200, where no
# tuning chose it (nor an H100's at 64 rows); the 70B verifies' shape for the PDL A/B below
k70s="--shape llama3_70b --layers 8 16 --compiled-layers --batches 1 8 --new-tokens 1 2 4 6 8 --cached-kernel split --linear-kernel skinny"
# programmatic dependent launch for one row's kernels (2026-12-06; on by default since the A/B of
# that day's fifth session on an H100: the 8B decode at batch 1 3.9 % faster, the rest as before):
# their blocks start while the kernel before finishes, load their first weights, then wait; without
# and with, in turn, twice at 8B (the tiles launch the same either way); then `t` (its graphed check
# captures steps with PDL and without). Not yet run on an H200.
o8="$v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 2 4 8 --cached-kernel split --linear-kernel skinny"
run o8_off $o8 --no-pdl --tag pdl_ab
run o8_on $o8 --pdl --tag pdl_ab
run o70_off $v $k70s --no-pdl --tag pdl_ab
run o70_on $v $k70s --pdl --tag pdl_ab
run o8_off_again $o8 --no-pdl --tag pdl_ab_again
run o8_on_again $o8 --pdl --tag pdl_ab_again
# the projected speed-ups with the kernels' step costs (#36: redo them with the new step costs,
# checked against the graphed loop): verifies of 1-5 tokens (chains of k <= 4), the loop with the
# target's layers compiled (the split-key attention and skinny maps, as serving runs them) at
# batches 1 and 8, then the costs at batches 32 and 64 for the projection's table
# (BLOCK_SHAPES: the picks given to both, so that the loop runs the kernels the costs were measured with)
kp="$v --shape llama3_8b --compiled-layers --new-tokens 1 2 3 4 5 --cached-kernel split --linear-kernel skinny ${BLOCK_SHAPES:+--block-shapes $BLOCK_SHAPES}"
run kp $kp --batches 1 8 --tag projection
# (KP_COSTS: an earlier run's costs, for the checks without kp, e.g. ..._projection_h100_run16.json)
kp_costs=${KP_COSTS:-benchmarks/results/verify_cost_llama3_8b_split_skinny_compiled_projection.json}
check="python -m benchmarks.check_projection --shape llama3_8b --k 3 --new 128 --compiled-layers --costs $kp_costs${BLOCK_SHAPES:+ --block-shapes $BLOCK_SHAPES}"
run kp_b1 $check --batch 1 --profile
run kp_b8 $check --batch 8 --profile
# the same checks drafting with an EAGLE-3 head (its 32,000-row draft vocabulary at this shape): the
# projection's draft step by vocabulary (`draft_step_ms_by_vocab`, in kp's costs) against the loop
run kp_e3_b1 $check --batch 1 --head eagle3
run kp_e3_b8 $check --batch 8 --head eagle3
run kp64 $kp --batches 32 64 --tag projection_b64
# the graphed loop's eager draft with its maps (its layer's and lm_head) through the skinny kernels
# (use_linear_kernel's in_graphs, off by default; 2026-12-08, not yet measured): A/B against kp_b1
# kp_e3_b1 kp_b8 kp_e3_b8 on the same machine (the loop's step replayed and its measured speed-up;
# projected with kp's costs, whose drafts ran without it), then `ig` for the costs with it
run ig_b1 $check --batch 1 --skinny-in-graphs --profile
run ig_e3_b1 $check --batch 1 --head eagle3 --skinny-in-graphs
run ig_b8 $check --batch 8 --skinny-in-graphs --profile
run ig_e3_b8 $check --batch 8 --head eagle3 --skinny-in-graphs
run ig $kp --batches 1 8 --skinny-in-graphs --tag projection
# the block shapes given instead of timed (2026-12-06, seventh session): run 10's fastest 8B picks
# (benchmarks/block_shapes_llama3_8b_h200.json) in two processes, then one timing its own
bp="$v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 2 4 8 --cached-kernel split --linear-kernel skinny"
run bp1 $bp --block-shapes benchmarks/block_shapes_llama3_8b_h200.json --tag given_shapes
run bp2 $bp --block-shapes benchmarks/block_shapes_llama3_8b_h200.json --tag given_shapes_again
run bp_timed $bp --tag timed_shapes
# SiLU·up in gate_up's epilogue for a tile of rows (`silu_gate_up`, 2026-12-06, seventh session):
# without and with, in turn, twice (on by default since this A/B, run 11 on an H100, 2026-12-07);
# BLOCK_SHAPES=benchmarks/block_shapes_llama3_8b_h200.json on an H200 gives the other maps run 10's
# fastest picks, so that their timing's ties do not decide it
ta="$v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 2 4 8 --cached-kernel split --linear-kernel skinny ${BLOCK_SHAPES:+--block-shapes $BLOCK_SHAPES}"
# the three built after run 10 at once, for a short device budget (2026-12-06, eighth session):
# none and all three, in turn, twice, then each alone (so that a call cut short has the A/B that decides)
none="--no-tile-activation"
run ab_off $ta $none --tag ab
run ab_all $ta --tile-activation --pdl-tiles --tile-norm --tag ab
run ab_off_again $ta $none --tag ab_again
run ab_all_again $ta --tile-activation --pdl-tiles --tile-norm --tag ab_again
run ab_ta $ta --tile-activation --tag ab
run ab_pt $ta $none --pdl-tiles --tag ab
run ab_tn $ta $none --tile-norm --tag ab
# an A/B in turn, twice: $1 the items' prefix, $2 the option off ("" for the defaults), $3 on, $4
# the file tag (_off, _on, _off_again, _on_again; tagged $4 and $4_again)
in_turn_twice() {
    run "$1_off" $ta $2 --tag "$4"
    run "$1_on" $ta $3 --tag "$4"
    run "$1_off_again" $ta $2 --tag "$4_again"
    run "$1_on_again" $ta $3 --tag "$4_again"
}
in_turn_twice ta --no-tile-activation --tile-activation tile_activation_ab
# PDL for the tiles too (2026-12-06, eighth session; `use_pdl`'s tiles, off by default: run 11's
# ab_pt 0-6 % slower): a verify's 16-64-row tiles and the attention over several
# query tokens launch with PDL, each tile's first weights loaded before the wait; on the defaults
in_turn_twice pt "" --pdl-tiles pdl_tiles_ab
# a tile's RMSNorms split between the maps around them (2026-12-06, eighth session;
# `use_linear_kernel`'s tile_norm, off by default; run 11's ab_tn: up to 4 % slower), on the defaults
in_turn_twice tn "" --tile-norm tile_norm_ab
run tb python -m pytest -q -m gpu tests/test_gpu.py -k "block_shapes"
run t python -m pytest -q -m gpu tests/test_gpu.py -k "triton"
run k_split_skinny $k --cached-kernel split --linear-kernel skinny
run k_split_skinny_unfolded $k --cached-kernel split --linear-kernel skinny --unfolded
run k_mixed_cublas $k --cached-kernel mixed --linear-kernel cublas
run p $v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 8 --profile --cached-kernel split --linear-kernel skinny
run p_unfolded $v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 8 --profile --cached-kernel split --linear-kernel skinny --unfolded
# run 11's all-three slowdown (the tiles' PDL with the norms split: batch 8's decode step 8-13 %
# slower, none of the three alone over 2 %), profiled by kernel kind beside p
run p_all $v --shape llama3_8b --compiled-layers --batches 1 8 --new-tokens 1 8 --profile --cached-kernel split --linear-kernel skinny --pdl-tiles --tile-norm --tag all_three
# 3 and 5 tokens too: the projection costs chains of k = 2 and 4 from them (run 12 had 2, 4, 6, 8)
k70="$v --shape llama3_70b --layers 8 16 --compiled-layers --batches 1 8 --new-tokens 1 2 3 4 5 6 8 --tag kernels"
run k70_split_skinny $k70 --cached-kernel split --linear-kernel skinny
run k70_mixed_cublas $k70 --cached-kernel mixed --linear-kernel cublas
run g python -m benchmarks.bench_gemv --shape llama3_8b
run decode64 python -m benchmarks.bench_decode --shape llama3_8b --batch 64 --new 128 --variants graph_compiled
run k_mixed_skinny $k --cached-kernel mixed --linear-kernel skinny
run spec_b1 python -m benchmarks.check_projection --shape llama3_8b --batch 1 --k 3 --new 128
run spec_b8 python -m benchmarks.check_projection --shape llama3_8b --batch 8 --k 3 --new 128
# decode64's step against the maps' kernels at batches 16-64 with decode64's cache (256 committed tokens)
k64="$v --shape llama3_8b --compiled-layers --batches 16 32 64 --new-tokens 1 2 4 --context 256 --tag b64"
run k64_split_skinny $k64 --cached-kernel split --linear-kernel skinny
run k64_split_cublas $k64 --cached-kernel split --linear-kernel cublas
run k64_mixed_cublas $k64 --cached-kernel mixed --linear-kernel cublas
p64="$v --shape llama3_8b --compiled-layers --batches 64 --new-tokens 1 --context 256 --profile --cached-kernel split --tag b64"
run p64 $p64 --linear-kernel skinny
run p64_cublas $p64 --linear-kernel cublas
run mixed $v --shape llama3_8b --cached-kernel mixed --compiled-layers
run flex $v --shape llama3_8b --cached-kernel flex --compiled-layers
run sdpa $v --shape llama3_8b --compiled-layers
run mixed_70b $v --shape llama3_70b --layers 8 16 --batches 1 8 --cached-kernel mixed --compiled-layers
run autotune $v --shape llama3_8b --compiled-layers --autotune --batches 1 8
run fp8 python -m benchmarks.bench_fp8 --shape llama3_8b --tokens 150000
run gpu_tests python -m pytest -q -m gpu tests/test_gpu.py tests/test_fp8.py
echo "== $(date +%T) finished"
touch "$log.finished"
