"""Hidden-state dump at the DeepSeek-V2-Lite shape (15.7B parameters, 2.4B active per token):
inference_ref's packed forward (varlen MLA, grouped-matmul MoE) vs transformers' `DeepseekV2Model`
(SDPA, length-sorted padded batches), one run, same random weights.

    python -m benchmarks.bench_precompute_deepseek --tokens 200000
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_precompute import side_by_side
from benchmarks.common import DEEPSEEK_V2_LITE, DEVICE, DTYPE, write_result
from inference_ref.attention import packed_kernel
from inference_ref.models.deepseek_v2 import (
    DeepseekV2Config,
    DeepseekV2Model,
    grouped_kernel,
    hf_state_dict,
    random_deepseek_v2,
)


def active_flops_per_token(cfg: DeepseekV2Config) -> float:
    """2 × the linear-layer parameters one token goes through (MLA projections, dense or
    shared + top-k routed experts), summed over layers."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = h * (heads * cfg.qk_head_dim + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    attn += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h
    dense = 3 * h * cfg.intermediate_size
    moe = 3 * h * cfg.moe_intermediate_size * (cfg.n_shared_experts + cfg.num_experts_per_tok)
    moe += h * cfg.n_routed_experts
    per_layer = [attn + (moe if cfg.is_moe(i) else dense) for i in range(cfg.num_hidden_layers)]
    return 2.0 * sum(per_layer)


def hf_copy(model: DeepseekV2Model):
    from transformers import DeepseekV2Config as HFConfig
    from transformers import DeepseekV2Model as HFModel

    with torch.device("meta"):
        hf = HFModel(HFConfig(**model.cfg.to_hf(), attn_implementation="sdpa"))
    weights = {k.removeprefix("model."): v for k, v in hf_state_dict(model, stacked=True).items()}
    weights.pop("lm_head.weight", None)
    hf.load_state_dict(weights, strict=False, assign=True)
    missing = [n for n, p in hf.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"transformers' model has weights this copy does not fill: {missing[:5]}")
    with torch.device(DEVICE):  # its non-persistent buffers were made on meta
        hf.rotary_emb = type(hf.rotary_emb)(hf.config)
    hf = hf.to(DEVICE).eval()
    on_meta = [n for n, b in hf.named_buffers() if b.is_meta]
    if on_meta:
        raise RuntimeError(f"buffers left on meta: {on_meta[:5]}")
    return hf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=None, help="override depth (quick checks)")
    args = p.parse_args()
    hf_cfg = dict(DEEPSEEK_V2_LITE, **({} if args.layers is None else {"num_hidden_layers": args.layers}))
    cfg = DeepseekV2Config.from_hf(hf_cfg)
    model = random_deepseek_v2(cfg, DEVICE, DTYPE)
    hf = hf_copy(model)
    run = side_by_side(model, hf, cfg, args.tokens, args.batch_tokens, warmup=2, agreement_tokens=512)
    ours_tps = run["inference_ref_packed_tokens_per_s"]
    flops = active_flops_per_token(cfg)
    write_result(
        "precompute_deepseek_v2_lite",
        {
            "command": f"python -m benchmarks.bench_precompute_deepseek --tokens {args.tokens}",
            "layers": cfg.num_hidden_layers,
            **run,
            "active_linear_gflop_per_token": flops / 1e9,
            "inference_ref_tflops_per_s": ours_tps * flops / 1e12,
            "attention_kernel": packed_kernel(),
            "expert_kernel": grouped_kernel(),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
        },
    )


if __name__ == "__main__":
    main()
