"""Parity of inference_ref's DeepSeek-V2 with transformers' `DeepseekV2ForCausalLM` (fp32, CPU):
packed forward, latent-cache decode and verify, greedy generation, both checkpoint layouts of the
experts, and the grouped expert matmuls against a per-expert reference."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import transformers
from safetensors.torch import save_file

from benchmarks.common import DEEPSEEK_V2_LITE
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.draft import MTPDraft
from inference_ref.generate import generate
from inference_ref.head_spec import HeadSpec
from inference_ref.loading import read_tensors, safetensors_files
from inference_ref.models import deepseek_v2 as ds
from inference_ref.models.deepseek_v2 import DeepseekV2Config, YarnScaling, load_deepseek_v2
from inference_ref.models.deepseek_v2 import moe as moe_module
from inference_ref.models.llama import LlamaConfig
from inference_ref.speculative import Chain, speculative_generate
from tiny import rel_err, tiny_deepseek

# The registry's tiny shape with more layers and experts, and YaRN past the test sequences.
VARIED = dict(
    num_hidden_layers=3,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    # The test sequences run past original_max_position_embeddings; mscale ≠ mscale_all_dim makes
    # both YaRN factors (on cos/sin and on the softmax scale) differ from 1.
    rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.707
    ),
    bos_token_id=1,
    eos_token_ids=(2,),
)
CONFIGS = {
    "lite": tiny_deepseek(**VARIED),
    # DeepSeek-V2 (full) options: low-rank q, group-limited routing, scaled routed experts.
    "q-lora-group-limited": tiny_deepseek(
        **VARIED,
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=4.0,
    ),
}


def hf_random(cfg: DeepseekV2Config, seed: int) -> transformers.DeepseekV2ForCausalLM:
    # A wider init than the default 0.02, so that attention is far from uniform and routing far
    # from ties: the parity checks then see rope, the softmax scale and the expert choice.
    hf_cfg = transformers.DeepseekV2Config(**cfg.to_hf(), initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.DeepseekV2ForCausalLM(hf_cfg).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers' model with random weights, ours loaded from its `save_pretrained` directory)."""
    cfg = CONFIGS[request.param]
    hf = hf_random(cfg, seed=0)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out, safe_serialization=True)
    return hf, load_deepseek_v2(out), out


def hf_logits_and_hidden(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, final-normed hidden state) for ids [B, S]."""
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state
        return hf.lm_head(hidden), hidden


def test_packed_forward_matches_transformers(pair):
    hf, model, _ = pair
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (70, 5, 41)]
    lengths = [len(s) for s in seqs]
    flat = torch.cat(seqs)
    hidden, logits = model.forward_packed(flat, cu_seqlens_of(lengths), torch.arange(len(flat)))
    start = 0
    for seq in seqs:
        end = start + len(seq)
        ref_logits, ref_hidden = hf_logits_and_hidden(hf, seq[None])
        with torch.inference_mode():
            assert rel_err(model.norm(hidden[start:end]), ref_hidden[0]) <= 1e-4
        assert rel_err(logits[start:end], ref_logits[0]) <= 1e-4
        start = end


def test_cached_prefill_decode_and_verify_match_transformers(pair):
    """Prefill, then steps of 1 and 3 tokens at per-row offsets (decode and verify), alternating
    the static (CUDA-graph) and dynamic masks, against transformers' full forward."""
    hf, model, _ = pair
    full = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    ref, _ = hf_logits_and_hidden(hf, full)
    cache = model.new_cache(2, 64)
    model.forward_cached(full[:, :20], cache)
    cache.lengths = torch.tensor([20, 13])  # row 1's entries 13…19 are scratch and get rewritten
    step = 0
    while int(cache.lengths.max()) < 56:
        new = 3 if step % 2 else 1
        cols = cache.lengths[:, None] + torch.arange(new)
        out = model.forward_cached(full.gather(1, cols), cache, static=step % 4 < 2)
        logits = model.logits(out)
        for b in range(2):
            assert rel_err(logits[b], ref[b, cols[b]]) <= 1e-4
        cache.lengths += new
        step += 1


def test_latent_cache_holds_only_the_latent_and_k_rope(pair):
    _, model, _ = pair
    cfg = model.cfg
    cache = model.new_cache(3, 17)
    assert cache.kv.shape == (cfg.num_hidden_layers, 3, 17, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache.max_len == 17 and cache.lengths.dtype == torch.long


def test_greedy_generation_matches_transformers(pair):
    hf, model, _ = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9)]
    eos = list(model.cfg.eos_token_ids)
    ours = generate(model, prompts, max_new_tokens=20, eos_ids=eos)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_finished_rows_leave_the_latent_cache_and_the_rest_decode_the_same(pair):
    """`generate(compact=True)` copies the unfinished rows of the latent cache (`LatentCache.rows`)."""
    _, model, _ = pair
    prompts = [[5, 6, 7, 8, 9], list(range(30, 47)), [100, 3, 200], [7] * 11]
    greedy = generate(model, prompts, max_new_tokens=20, eos_ids=[])
    eos = [greedy[0][2], greedy[1][3]]  # rows 0 and 1 stop early
    plain = generate(model, prompts, max_new_tokens=20, eos_ids=eos)
    assert sorted(map(len, plain))[1] < 20 == max(map(len, plain))  # 2 of 4 done while others decode
    assert generate(model, prompts, max_new_tokens=20, eos_ids=eos, compact=True) == plain


def test_speculative_decoding_through_the_latent_cache_equals_greedy(pair):
    """The speculative loop (verify k + 1 tokens, commit a per-row count) with this target and a
    random Llama-kind draft reproduces the target's own greedy output."""
    _, model, _ = pair
    torch.manual_seed(0)
    layer = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    draft = MTPDraft(HeadSpec("rmsnorm-restored", layer)).eval().requires_grad_(False)
    draft.share(model, {})
    prompts = [[5, 6, 7, 8, 9], list(range(30, 47)), [100, 3, 200]]
    eos = list(model.cfg.eos_token_ids)
    spec = speculative_generate(model, draft, prompts, max_new_tokens=20, eos_ids=eos, shape=Chain(3))
    assert spec.tokens == generate(model, prompts, max_new_tokens=20, eos_ids=eos)


def test_stacked_expert_checkpoint_loads_the_same(pair, tmp_path):
    """transformers writes one tensor per expert (as the hub checkpoints are); its in-memory state
    dict has them stacked. Both load to the same model, and `hf_state_dict` writes both back."""
    hf, model, per_expert_dir = pair
    stacked = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in stacked)
    save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(model.cfg.to_hf()))
    from_stacked = load_deepseek_v2(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(from_stacked.state_dict()[name], tensor), name

    ours_stacked = ds.hf_state_dict(model, stacked=True)
    assert ours_stacked.keys() == stacked.keys()
    assert all(torch.equal(ours_stacked[k], stacked[k]) for k in stacked)
    files = read_tensors(per_expert_dir, list(safetensors_files(per_expert_dir)))
    ours_per_expert = ds.hf_state_dict(model)
    assert ours_per_expert.keys() == files.keys()
    assert all(torch.equal(ours_per_expert[k], files[k]) for k in files)


def test_grouped_experts_equal_a_per_expert_reference():
    cfg = CONFIGS["lite"]
    moe = ds.random_deepseek_v2(cfg, seed=3).layers[1].mlp
    for tokens in (50, 2):  # 2 tokens × 3 experts leave experts without rows
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
        weights, ids = moe.router(x)
        ref = torch.zeros_like(x)
        for e in range(cfg.n_routed_experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = (x[rows] @ moe.experts.gate_up_proj[e].T).chunk(2, -1)
            y = (torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e].T
            ref.index_add_(0, rows, y * weights[rows, slot, None])
        assert rel_err(moe.experts(x, weights, ids), ref) <= 1e-5
        assert rel_err(moe.experts(x, weights, ids, linear=ds.grouped_linear_loop), ref) <= 1e-5
    if moe_module._GROUPED_MM is not None:
        assert ds.grouped_kernel() == "grouped_mm"  # the check above ran the grouped kernel


def test_config_round_trip_and_hub_lite_config():
    for cfg in CONFIGS.values():
        assert DeepseekV2Config.from_hf(cfg.to_hf()) == cfg
    lite = DeepseekV2Config.from_hf(DEEPSEEK_V2_LITE)
    assert (lite.q_lora_rank, lite.kv_lora_rank, lite.qk_head_dim, lite.v_head_dim) == (None, 512, 192, 128)
    assert (lite.n_routed_experts, lite.num_experts_per_tok, lite.n_shared_experts) == (64, 6, 2)
    assert lite.rope_scaling == YarnScaling(40, 4096, 32, 1, mscale=0.707, mscale_all_dim=0.707)
    assert lite.eos_token_ids == (100001,) and lite.model_type == "deepseek_v2"
    assert ds.softmax_scale(lite) == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    assert ds.rope_magnitude(lite) == 1.0  # mscale = mscale_all_dim
    assert lite.fingerprint() != dataclasses.replace(lite, kv_lora_rank=256).fingerprint()


def test_yarn_tables_equal_transformers_at_the_lite_rope_shape():
    """V2-Lite's rope (64 dims, factor 40, original 4096) on a tiny model: inverse frequencies,
    cos/sin magnitude and softmax scale as transformers computes them."""
    rope = {**DEEPSEEK_V2_LITE["rope_scaling"], "mscale": 1.0}  # make the cos/sin magnitude ≠ 1 as well
    cfg = dataclasses.replace(
        CONFIGS["lite"],
        qk_rope_head_dim=64,
        max_position_embeddings=163840,
        rope_scaling=ds.yarn_from_hf(rope, 163840),
    )
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**cfg.to_hf()))
    assert torch.equal(ds.rope_inv_freq(cfg), hf.model.rotary_emb.inv_freq)
    assert ds.rope_magnitude(cfg) == hf.model.rotary_emb.attention_scaling != 1.0
    assert ds.softmax_scale(cfg) == hf.model.layers[0].self_attn.scaling


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
)
def test_unsupported_options_raise(change, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV2Config.from_hf({**DEEPSEEK_V2_LITE, **change})
