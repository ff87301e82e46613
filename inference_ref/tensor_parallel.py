"""A target's layers sharded over a tensor-parallel group with PyTorch's own tensor parallelism
(`torch.distributed.tensor.parallel`, DTensor device meshes), Megatron's layout:

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads / its MLP columns
    o_proj, down_proj        row-parallel: partial sums, all-reduced (one all-reduce each)
    embed_tokens             vocab-parallel rows (untied targets: 2 GB each at Llama-70B)
    lm_head                  vocab-parallel columns, logits gathered (untied targets)

so a layer costs two all-reduces, and the attention kernels, rotary and the KV cache see the rank's
local heads only. The fused projections hold [q | k | v] and [gate | up]; their rows are interleaved
per rank first ([q_0 k_0 v_0 | q_1 k_1 v_1 | …]) so that an even row split gives each rank a whole
local [q_r | k_r | v_r]. Everything else (norms, rotary, a tied embedding) stays replicated, so the
rest of the code sees plain tensors: hidden states leave each layer whole on every rank.

The mesh is `("dp", "tp")`: consecutive ranks form a tensor-parallel group (the GPUs of a node,
over NVLink), groups split the data. A checkpoint is loaded layer by layer and each rank keeps only
its shards (`load_parallel`), so a 70B target never sits whole in any process's memory.

Kinds: those whose layers are Llama's (`TargetKind.fuse_layer`): Llama, Qwen3. MLA and MoE
layers need their own plans (latent projections, experts) and are refused with that said.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from inference_ref.causal_lm import CausalLM
from inference_ref.loading import EMBED, FINAL_NORM, LM_HEAD, read_tensors, safetensors_files
from inference_ref.models import TARGET_KINDS

GiB = 1 << 30


def device_mesh(tp_size: int, device: torch.device) -> DeviceMesh:
    """The ("dp", "tp") mesh over every rank of the initialized process group: groups of `tp_size`
    consecutive ranks shard the target, world / tp_size groups split the data."""
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"model.tp_size={tp_size} does not divide the {world} processes launched")
    return init_device_mesh(device.type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def check_shardable(cfg, tp: int) -> None:
    """Refuse a kind or shape the plan cannot split `tp` ways, naming the field."""
    if TARGET_KINDS[cfg.model_type].fuse_layer is None:
        raise ValueError(
            f"model.tp_size={tp}: tensor parallelism covers Llama-layer kinds "
            f"({', '.join(k for k, v in TARGET_KINDS.items() if v.fuse_layer)}), not {cfg.model_type} "
            "(its MLA/MoE layers need their own plan); use model.tp_size=1"
        )
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, field) % tp:
            raise ValueError(
                f"model.tp_size={tp} does not divide the target's {field} ({getattr(cfg, field)})"
            )


def interleave_rows(weight: torch.Tensor, sizes: list[int], tp: int) -> torch.Tensor:
    """Rows [A | B | …] (block sizes `sizes`) → [A_0 B_0 … | A_1 B_1 … | …]: rank r's even share
    of the result is its own part of every block."""
    blocks = [block.chunk(tp) for block in weight.split(sizes)]
    return torch.cat([part for r in range(tp) for part in (b[r] for b in blocks)])


def fused_blocks(cfg, name: str) -> list[int] | None:
    """The row blocks of a fused projection (`layers.i.…`), or None for any other tensor."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    if name.endswith("mlp.gate_up_proj.weight"):
        return [cfg.intermediate_size, cfg.intermediate_size]
    return None


def plan(model: CausalLM) -> dict:
    """`parallelize_module`'s plan for a Llama-layer model (module names → styles)."""
    styles = {}
    if not model.cfg.tie_word_embeddings:  # a tied table stays whole: one tensor cannot be both
        styles["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        styles["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        styles[p + "self_attn.qkv_proj"] = ColwiseParallel()
        styles[p + "self_attn.o_proj"] = RowwiseParallel()
        styles[p + "mlp.gate_up_proj"] = ColwiseParallel()
        styles[p + "mlp.down_proj"] = RowwiseParallel()
    return styles


def apply_plan(model: CausalLM, mesh: DeviceMesh) -> CausalLM:
    """Shard `model` (its fused rows already interleaved, or on meta) over `mesh` and make its
    attention and cache count local heads."""
    tp = mesh.size()
    parallelize_module(model, mesh, plan(model))
    for layer in model.layers:
        layer.self_attn.n_heads //= tp
        layer.self_attn.n_kv //= tp
    model.tp_size = tp
    return model


def parallelize(model: CausalLM, mesh: DeviceMesh) -> CausalLM:
    """Shard a built model (the same weights on every rank, e.g. from one seed) over `mesh`."""
    check_shardable(model.cfg, mesh.size())
    with torch.no_grad():
        for name, p in model.named_parameters():
            blocks = fused_blocks(model.cfg, name)
            if blocks is not None:
                p.data = interleave_rows(p.data, blocks, mesh.size())
    return apply_plan(model, mesh)


def sharded_skeleton(cfg, mesh: DeviceMesh, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model's modules sharded over `mesh`, with uninitialized local storage on `device`."""
    check_shardable(cfg, mesh.size())
    with torch.device("meta"):
        model = TARGET_KINDS[cfg.model_type].model(cfg)
    model.to(dtype=dtype)
    apply_plan(model, mesh)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(cfg).to(device)  # its fp32 table, rebuilt (to_empty left it blank)
    return model.eval().requires_grad_(False)


def put(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the whole tensor `full` into `param` (sharded or replicated)."""
    if isinstance(param, DTensor):
        full = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
        param.to_local().copy_(full.to_local())
    else:
        param.copy_(full)


def load_parallel(path: Path, cfg, mesh: DeviceMesh, device, dtype) -> CausalLM:
    """A Hugging Face checkpoint loaded straight into its shards, one layer at a time: each rank
    holds one layer's whole tensors on the host at most, and its own shards on `device`."""
    device = torch.device(device)
    model = sharded_skeleton(cfg, mesh, device, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    tp = mesh.size()
    fuse = TARGET_KINDS[cfg.model_type].fuse_layer
    with torch.no_grad():
        shared = read_tensors(path, [EMBED, FINAL_NORM] + ([] if cfg.tie_word_embeddings else [LM_HEAD]))
        put(params["embed_tokens.weight"], shared[EMBED].to(dtype))
        put(params["norm.weight"], shared[FINAL_NORM].to(dtype))
        if not cfg.tie_word_embeddings:
            put(params["lm_head.weight"], shared[LM_HEAD].to(dtype))
        where = safetensors_files(path)
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}."
            hf = read_tensors(path, [n for n in where if n.startswith(prefix)])
            for name, full in fuse(hf, prefix, f"layers.{i}.").items():
                blocks = fused_blocks(cfg, name)
                full = full if blocks is None else interleave_rows(full, blocks, tp)
                put(params[name], full.to(dtype))
    return model


def random_parallel(cfg, mesh: DeviceMesh, device, dtype, seed: int = 0) -> CausalLM:
    """Random weights at a given shape made straight into the shards (benchmarks of targets that fit
    no single GPU): norms near 1, everything else N(0, 0.02). Each rank draws its own shards, and
    the replicated tensors from a generator seeded alike on every rank, so that they agree."""
    model = sharded_skeleton(cfg, mesh, torch.device(device), dtype)
    own = torch.Generator(device=device).manual_seed(seed + 1 + mesh.get_local_rank())
    common = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = isinstance(p, DTensor)
            local = p.to_local() if sharded else p
            mean, std = (1.0, 0.1) if "norm" in name else (0.0, 0.02)
            local.normal_(mean, std, generator=own if sharded else common)
    return model


# --- will it fit ------------------------------------------------------------------------------


def weight_bytes_per_rank(cfg, tp: int, bytes_per_weight: float, fp8: bool = False) -> int:
    """The bytes of weights each of `tp` ranks holds: layers' linear maps and an untied vocabulary
    table split, norms and a tied table whole. `fp8`: the layers' linear maps at one byte (plus a
    scale per output channel), the rest at `bytes_per_weight`, and on top what loading adds for the
    layer being quantized (`quantization.quantize_onto`): its maps at `bytes_per_weight` and two
    fp32 temporaries of the largest (`quantize_rows`)."""
    from inference_ref.quantization import quantizable

    with torch.device("meta"):
        model = TARGET_KINDS[cfg.model_type].model(cfg)
    split = set(plan(model)) if tp > 1 else set()
    # per layer, the sizes of the maps FP8 quantizes, by module
    maps = [{id(m): m.weight.numel() for _, m in quantizable(layer)} for layer in model.layers] if fp8 else []
    fp8_maps = {i for layer in maps for i in layer}
    total, seen = 0.0, set()
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:  # a tied vocabulary table, once
                continue
            seen.add(id(p))
            share = p.numel() / (tp if module_name in split else 1)
            total += share * (1 + 4 / p.shape[-1] if id(module) in fp8_maps else bytes_per_weight)
    if fp8:
        sizes = [list(layer.values()) for layer in maps]
        total += max(map(sum, sizes)) * bytes_per_weight + 2 * 4 * max(map(max, sizes))
    return int(total)


def check_fits(
    cfg, tp: int, device: torch.device, dtype: torch.dtype, quantization: str, headroom: float
) -> None:
    """Refuse, before any weight is read, a target whose weights leave less than `headroom` of the
    GPU free at this tp_size, with the bytes needed against free and the overrides that would fit."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    per_weight = torch.empty((), dtype=dtype).element_size()
    error = fit_error(cfg, tp, per_weight, free, total, headroom, quantization.startswith("fp8"))
    if error:
        raise ValueError(f"{device}: {error}")


def fit_error(cfg, tp: int, per_weight: int, free: int, total: int, headroom: float, fp8: bool) -> str | None:
    """Why the weights (`per_weight` bytes each; `fp8`: see `weight_bytes_per_rank`) do not fit
    `free` of `total` bytes keeping `headroom` (None where they do), with the smallest tp_size (or,
    in one process, FP8) that would."""
    budget = free - headroom * total
    need = weight_bytes_per_rank(cfg, tp, per_weight, fp8)
    if need <= budget:
        return None
    # FP8 runs in one process only (`load_target`): more ranks are offered without it
    fits = [t for t in (2, 4, 8, 16) if t > tp and weight_bytes_per_rank(cfg, t, per_weight) <= budget]
    hint = f"model.tp_size={fits[0]} (launch that many processes)" if fits else "more GPUs per group"
    if fp8:
        hint = f"model.quantization=none with {hint}"
    elif tp == 1 and weight_bytes_per_rank(cfg, 1, per_weight, fp8=True) <= budget:
        hint += " or model.quantization=fp8"
    return (
        f"the target's weights need {need / GiB:.1f} GiB per GPU at model.tp_size={tp}, but "
        f"{free / GiB:.1f} GiB of {total / GiB:.1f} are free and {headroom:.0%} is kept for "
        f"activations and caches: use {hint}"
    )
