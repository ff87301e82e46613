"""DeepSeek-V2 target (V2-Lite shape) for inference: packed forward (precompute) and latent-cache decode.

Same skeleton as every kind (`inference_ref.causal_lm.CausalLM`): `forward_packed`, `new_cache`,
`forward_cached`, `logits`, with hidden states returned *before* the final norm.

Two parts differ from Llama, each a module of its own so that a head can build one alone:

- `mla`: multi-head latent attention. Keys and values come from one compressed latent per token
  (`kv_lora_rank` wide, after `kv_a_layernorm`) plus one rotated key part shared by all heads
  (`qk_rope_head_dim`). The decode cache holds only those two, 576 numbers per token and layer
  for V2-Lite instead of 16 heads × (192 + 128) for full K/V.
- `moe`: mixture of experts. After `first_k_dense_replace` dense layers, each layer routes a token
  to `num_experts_per_tok` of `n_routed_experts` experts (softmax gate) and adds `n_shared_experts`
  always-on experts. Expert weights are stacked [E, ...] and run as grouped matmuls.

Rotary embeddings rotate interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints expect,
not Llama's halves, and YaRN scaling changes both the rope magnitude and the softmax scale
(`config`). `model` holds the decoder layer, the model and its weights.
"""

from inference_ref.models.deepseek_v2.config import (
    LATENT_NORM_EPS,
    DeepseekV2Config,
    YarnScaling,
    check_supported,
    read_deepseek_v2_config,
    rope_inv_freq,
    rope_magnitude,
    softmax_scale,
    yarn_from_hf,
    yarn_mscale,
)
from inference_ref.models.deepseek_v2.mla import LatentAttention, LatentCache, Rotary, apply_rotary
from inference_ref.models.deepseek_v2.model import (
    TINY,
    DecoderLayer,
    DeepseekV2Model,
    build_model,
    fuse_block,
    fuse_experts,
    fuse_head_layer,
    fuse_hf_state_dict,
    fuse_layer,
    fuse_top,
    head_layer,
    hf_state_dict,
    load_deepseek_v2,
    random_deepseek_v2,
)
from inference_ref.models.deepseek_v2.moe import (
    DenseMLP,
    Experts,
    MoE,
    Router,
    grouped_kernel,
    grouped_linear,
    grouped_linear_loop,
)

__all__ = [
    "LATENT_NORM_EPS",
    "DeepseekV2Config",
    "YarnScaling",
    "check_supported",
    "read_deepseek_v2_config",
    "rope_inv_freq",
    "rope_magnitude",
    "softmax_scale",
    "yarn_from_hf",
    "yarn_mscale",
    "LatentAttention",
    "LatentCache",
    "Rotary",
    "apply_rotary",
    "DecoderLayer",
    "DeepseekV2Model",
    "build_model",
    "fuse_experts",
    "fuse_hf_state_dict",
    "fuse_layer",
    "fuse_top",
    "hf_state_dict",
    "load_deepseek_v2",
    "random_deepseek_v2",
    "TINY",
    "fuse_block",
    "fuse_head_layer",
    "head_layer",
    "DenseMLP",
    "Experts",
    "MoE",
    "Router",
    "grouped_kernel",
    "grouped_linear",
    "grouped_linear_loop",
]
