"""The FP8 target: quantize/dequantize math, the FP8 linear map against a reference matmul, block-
scaled checkpoints, and a quantized target end to end (on CPU the quantized product is computed in
fp32; on Hopper `torch._scaled_mm` runs it, GPU test marked)."""

from __future__ import annotations

import pytest
import torch

from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models.llama import random_llama
from inference_ref.quantization import (
    FP8_MAX,
    Fp8Linear,
    calibration,
    dequantize_blocks,
    dequantize_rows,
    quantize,
    quantize_rows,
)
from tiny import tiny_llama


def test_row_quantization_keeps_each_row_within_e4m3_precision():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((64,), FP8_MAX))  # each row uses the range
    rel = (dequantize_rows(q, scale) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert rel.max() <= 2**-4  # 3 mantissa bits: half an ulp of the largest is 1/16 of it at most
    zero, zscale = quantize_rows(torch.zeros(2, 8))  # no division by zero
    assert torch.equal(dequantize_rows(zero, zscale), torch.zeros(2, 8))


def test_fp8_linear_matches_the_reference_quantized_matmul():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 48, bias=False)
    torch.nn.init.normal_(linear.weight, generator=g)
    x = torch.randn(5, 7, 96, generator=g)
    fp8 = Fp8Linear.of(linear)
    wq, ws = quantize_rows(linear.weight.detach())
    xq, xs = quantize_rows(x.reshape(-1, 96))
    ref = (xq.float() * xs) @ (wq.float() * ws).t()  # the product FP8 tensor cores compute, in fp32
    assert torch.allclose(fp8(x).reshape(-1, 48), ref, rtol=1e-5, atol=1e-5)
    exact = x @ linear.weight.t()
    assert ((fp8(x) - exact).norm() / exact.norm()) < 0.06  # and close to the unquantized one


def test_block_scaled_checkpoints_dequantize_tile_by_tile():
    q = torch.randn(200, 300).clamp(-400, 400).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3) + 0.5  # ceil(200/128) × ceil(300/128) tiles
    w = dequantize_blocks(q, scale_inv)
    assert torch.equal(w[:128, :128], q[:128, :128].float() * scale_inv[0, 0])
    assert torch.equal(w[128:, 256:], q[128:, 256:].float() * scale_inv[1, 2])


def test_a_quantized_target_stays_close_to_the_unquantized_one():
    cfg = tiny_llama(num_hidden_layers=3)
    model = random_llama(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(2))
    ref, _ = model.forward_packed(ids, cu_seqlens_of([50]))
    quantize(model)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 3 * 4  # qkv, o, gate_up, down
    assert not isinstance(model.lm_head, Fp8Linear)
    out, _ = model.forward_packed(ids, cu_seqlens_of([50]))
    with torch.inference_mode():
        a, b = model.norm(out), model.norm(ref)
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min()
    assert cosine > 0.99, cosine


def test_a_static_input_scale_is_calibrated_then_fixed():
    """Static input scales (`quantize(..., static_inputs=True)`): inside `calibration` each map's
    scale widens to the largest absmax / 448 of its inputs, then stays; every token is quantized
    with it (the product is the reference's with that one scale) and an input past the calibrated
    range saturates at ±448 × scale. An uncalibrated map refuses to run."""
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(64, 32, bias=False)
    torch.nn.init.normal_(linear.weight, generator=g)
    model = torch.nn.Sequential(Fp8Linear.of(linear, static_input=True))
    fp8 = model[0]
    with pytest.raises(RuntimeError, match="not calibrated"):
        fp8(torch.randn(2, 64))
    first, second = torch.randn(16, 64, generator=g), 3 * torch.randn(16, 64, generator=g)
    with calibration(model):
        model(first)
        assert fp8.input_scale == first.abs().max() / FP8_MAX
        model(second)
        model(torch.empty(0, 64))  # no tokens: nothing to widen by
    scale = second.abs().max() / FP8_MAX
    assert not fp8.calibrating and torch.allclose(fp8.input_scale, scale)

    later = 10 * torch.randn(8, 64, generator=g)  # past the calibrated range: saturates
    wq, ws = quantize_rows(linear.weight.detach())
    xq = (later / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    ref = (xq.float() * scale) @ (wq.float() * ws).t()
    assert torch.allclose(fp8(later), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(fp8.input_scale, scale)  # fixed
    assert not torch.allclose(fp8(later), Fp8Linear.of(linear)(later), rtol=0.1)  # not per token
    with pytest.raises(ValueError, match="no FP8 maps with static"):
        with calibration(torch.nn.Sequential(Fp8Linear.of(linear))):
            pass


def test_a_target_with_static_input_scales_stays_close_to_the_unquantized_one():
    cfg = tiny_llama(num_hidden_layers=3)
    model = random_llama(cfg, seed=0)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=g)
    ref, _ = model.forward_packed(ids, cu_seqlens_of([50]))
    quantize(model, static_inputs=True)
    with calibration(model):
        model.forward_packed(torch.randint(0, cfg.vocab_size, (512,), generator=g), cu_seqlens_of([256, 256]))
    maps = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(maps) == 3 * 4 and all(m.calibrated_tokens == 512 for m in maps)
    out, _ = model.forward_packed(ids, cu_seqlens_of([50]))
    with torch.inference_mode():
        cosine = torch.nn.functional.cosine_similarity(model.norm(out), model.norm(ref), dim=-1).min()
    assert cosine > 0.99, cosine


@pytest.mark.gpu
@pytest.mark.parametrize("static_input", [False, True])
def test_scaled_mm_matches_the_cpu_reference(static_input):
    linear = torch.nn.Linear(256, 128, bias=False)
    x = torch.randn(64, 256).bfloat16().float()  # the same inputs on both paths (the GPU's are bf16)
    fp8 = Fp8Linear.of(linear, static_input)
    if static_input:  # the same fixed scale on both paths
        with calibration(torch.nn.Sequential(fp8)):
            fp8(x)
    cpu = fp8(x)
    gpu = fp8.cuda()(x.cuda().bfloat16()).float().cpu()
    assert ((gpu - cpu).norm() / cpu.norm()) < 1e-2


def test_static_input_scales_compile_after_calibration():
    """Calibration runs eagerly (a compiled frame would keep its graph breaks); the compiled layers
    traced afterwards give the eager output. Uncalibrated, a compiled target refuses to run too."""
    model = random_llama(tiny_llama(num_hidden_layers=2), seed=0)
    quantize(model, static_inputs=True)
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0))
    model.compile_layers()
    with pytest.raises(RuntimeError, match="not calibrated"):
        model.forward_packed(ids, cu_seqlens_of([64]))
    model.compile_layers()
    with calibration(model):
        eager, _ = model.forward_packed(ids, cu_seqlens_of([64]))
    assert model.compiled_layers
    compiled, _ = model.forward_packed(ids, cu_seqlens_of([64]))
    assert model.compile_proven == {"packed"} and torch.allclose(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_an_fp8_deepseek_target_decodes_through_its_latent_cache(kind):
    """MLA's cached forward reads kv_b_proj's weight as a matrix (weight absorption), so FP8 keeps
    it in the model's dtype (`quantization.KEPT`): a quantized DeepSeek target decodes, greedy,
    the first token the unquantized one does (a random tiny target)."""
    from inference_ref.generate import generate
    from inference_ref.models import TARGET_KINDS

    cfg = TARGET_KINDS[kind].config(**{"vocab_size": 256, **TARGET_KINDS[kind].tiny})
    model = TARGET_KINDS[kind].random(cfg, seed=0)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    want = generate(model, prompts, 4, eos_ids=[])
    quantize(model)
    assert not isinstance(model.layers[0].self_attn.kv_b_proj, Fp8Linear)
    assert isinstance(model.layers[0].self_attn.o_proj, Fp8Linear)
    got = generate(model, prompts, 4, eos_ids=[])
    assert [g[:1] for g in got] == [w[:1] for w in want]
