"""CUDA paths (skipped without a GPU): the packed kernel, bf16 agreement, a training step."""

from __future__ import annotations

import pytest
import torch

from inference_ref.attention import _sdpa_per_sequence, packed_causal_attention, packed_kernel
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.models.llama import LlamaConfig, random_llama
from mtp_train.batching import collate
from mtp_train.heads import HeadSpec, MTPHead
from mtp_train.losses import DraftObjective, LossWeights, draft_loss

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def test_packed_kernel_matches_sdpa_per_sequence():
    torch.manual_seed(0)
    lens = [37, 300, 5, 128]
    cu = cu_seqlens_of(lens, device="cuda")
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = packed_causal_attention(q, k, v, cu, max(lens))
    # The varlen kernel must have run: a silent fallback would compare the reference with itself.
    assert packed_kernel().startswith("varlen_attn"), packed_kernel()
    torch.testing.assert_close(got, _sdpa_per_sequence(q, k, v, cu), atol=2e-2, rtol=2e-2)


def test_bf16_packed_forward_matches_fp32():
    model = random_llama(CFG, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, CFG.vocab_size, (400,), device="cuda")
    cu = cu_seqlens_of([150, 250], device="cuda")
    ref, _ = model.forward_packed(ids, cu)
    low, _ = model.to(torch.bfloat16).forward_packed(ids, cu)
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel


def test_compiled_layers_match_eager_on_new_shapes():
    """`compile_layers` fuses the elementwise chains; states stay within bf16 rounding of the eager
    forward, also for batches of other lengths and counts (dynamic shapes, no recompile error)."""
    model = random_llama(CFG, device="cuda", dtype=torch.bfloat16)
    batches = [[150, 250], [7, 300, 41, 2], [1000]]
    inputs = [
        (torch.randint(0, CFG.vocab_size, (sum(b),), device="cuda"), cu_seqlens_of(b, "cuda"))
        for b in batches
    ]
    eager = [model.forward_packed(ids, cu)[0] for ids, cu in inputs]
    model.compile_layers()
    for (ids, cu), ref in zip(inputs, eager):
        fused, _ = model.forward_packed(ids, cu)
        rel = (fused.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 1e-2, rel


def test_compiled_decoding_matches_eager():
    """Compiled layers in the cached forward: the graphed decode step replays fused kernels that
    give the eager layers' tokens in fp32, for one and many rows (the speculative step:
    test_speculative's `test_cuda_loop`)."""
    from inference_ref.generate import generate

    torch.manual_seed(0)
    model = random_llama(CFG, device="cuda", dtype=torch.float32)
    prompts = [torch.randint(0, CFG.vocab_size, (n,)).tolist() for n in (5, 40, 17, 1, 90)]
    eager = generate(model, prompts, 24, eos_ids=[])
    model.compile_layers()
    assert generate(model, prompts, 24, eos_ids=[]) == eager
    assert generate(model, prompts[:1], 24, eos_ids=[]) == eager[:1]
    assert model.compile_proven == {"cached"} and model.runs_compiled("cached")


def test_training_step_on_gpu():
    g = torch.Generator().manual_seed(0)
    frozen = {
        "model.embed_tokens.weight": torch.randn(CFG.vocab_size, CFG.hidden_size, generator=g),
        "model.norm.weight": torch.ones(CFG.hidden_size),
        "lm_head.weight": torch.randn(CFG.vocab_size, CFG.hidden_size, generator=g) * 0.05,
    }
    head = MTPHead(HeadSpec("rmsnorm-restored", CFG), frozen).cuda()
    objective = DraftObjective(head, LossWeights(), chunk_logits=64 * CFG.vocab_size, decay=0.8)
    samples = [
        (
            torch.randint(0, CFG.vocab_size, (n,)),
            torch.ones(n, dtype=torch.long),
            torch.randn(n, CFG.hidden_size),
        )
        for n in (64, 200, 33)
    ]
    for steps in (1, 3):
        batch = collate(samples, steps=steps).to("cuda", torch.float32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = objective(batch)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in head.parameters())
        head.zero_grad()


def test_fp32_head_attention_runs_the_bf16_kernel_and_returns_fp32_gradients():
    import inference_ref.attention as attention
    from mtp_train.head_attention import Segments, head_attention

    torch.manual_seed(0)
    lens = [37, 300, 5, 128]
    cu = cu_seqlens_of(lens, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, 64, device="cuda", requires_grad=True) for h in (8, 2, 2))
    out = head_attention(q, [(k, v)], Segments(cu, max(lens)))
    assert attention._VARLEN is not None and attention._varlen_failed is None  # the kernel ran
    assert out.dtype == torch.float32
    ref = _sdpa_per_sequence(q.detach(), k.detach(), v.detach(), cu)
    torch.testing.assert_close(out.detach(), ref, atol=2e-2, rtol=2e-2)
    out.square().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(k.grad).all() and v.grad.abs().sum() > 0


def test_flash_lse_attention_matches_the_exact_path_with_gradients():
    from inference_ref.attention import varlen_with_lse
    from mtp_train.head_attention import Segments, head_attention

    torch.manual_seed(0)
    lens = [37, 300, 5, 128]
    seg = Segments(cu_seqlens_of(lens, device="cuda"), max(lens))
    T = sum(lens)
    make = lambda h: torch.randn(T, h, 64, device="cuda", requires_grad=True)  # noqa: E731
    q, k0, v0, k1, v1 = make(8), make(2), make(2), make(2), make(2)
    half = [t.detach().bfloat16() for t in (q, k0, v0)]
    assert varlen_with_lse(*half, seg.cu_seqlens, seg.max_len) is not None  # the flash path runs
    got = head_attention(q, [(k0, v0), (k1, v1)], seg)  # chained step 1: the lse merge
    grads = torch.autograd.grad(got.square().sum(), (q, k0, v0))
    import mtp_train.head_attention as ha

    before, ha._flash_lse_usable = ha._flash_lse_usable, False  # the exact path for the reference
    try:
        ref = head_attention(q, [(k0, v0), (k1, v1)], seg)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k0, v0))
    finally:
        ha._flash_lse_usable = before
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
    for g, r in zip(grads, ref_grads):
        assert float((g - r).norm() / r.norm()) < 2e-2


def test_compiled_loss_chunks_match_eager_in_bf16():
    """train.compile_loss: the fused chunk gives eager's loss, top-1 and gradient (bf16 logits,
    fp32 softmax), the last chunk shorter than the others (the dynamic-rows recompile)."""
    torch.manual_seed(0)
    z = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    lm_head = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    sums = []
    for compiled in (False, True):
        s = draft_loss(z, target, lm_head, LossWeights(), chunk=384, compiled=compiled)
        (grad,) = torch.autograd.grad(s.loss, z)
        sums.append((s.loss, s.top1, grad.float()))
    (eager_loss, eager_top1, eager_grad), (loss, top1, grad) = sums
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=0)
    assert abs(top1.item() - eager_top1.item()) <= 2  # argmax ties may break otherwise
    torch.testing.assert_close(grad, eager_grad, rtol=2e-2, atol=1e-4)


def test_an_fp8_target_loads_without_holding_its_bf16_weights(tmp_path):
    """`load_target(quantization="fp8")` quantizes layer by layer on the way to the GPU
    (`quantization.quantize_onto`): the peak is what `weight_bytes_per_rank(..., fp8=True)` counts
    for `check_fits`, well under the bf16 weights the whole model would take."""
    import json

    from safetensors.torch import save_file

    from inference_ref.target import load_target
    from inference_ref.tensor_parallel import weight_bytes_per_rank
    from mtp_train.target_files import random_hf_weights

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
    )
    save_file(
        {k: v.contiguous() for k, v in random_hf_weights(cfg, 0).items()}, str(tmp_path / "model.safetensors")
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_target(tmp_path, "cuda", torch.bfloat16, quantization="fp8")
    peak = torch.cuda.max_memory_allocated() - base
    counted, bf16 = weight_bytes_per_rank(cfg, 1, 2, fp8=True), weight_bytes_per_rank(cfg, 1, 2)
    assert peak <= 1.02 * counted and counted < 0.7 * bf16
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("check", ["split_kv", "skinny", "qkv_rope_cache", "block_shapes", "draft_in_graphs"])
def test_triton_kernel_in_bf16(check):
    from kernel_checks import CHECKS

    CHECKS[check]("cuda", torch.bfloat16)


def test_graphed_steps_through_the_triton_kernels():
    from kernel_checks import check_graphed_steps

    check_graphed_steps("cuda", torch.bfloat16)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_target_steps_through_the_triton_kernels(compiled):
    from kernel_checks import check_model_steps

    check_model_steps("cuda", torch.bfloat16, compiled)
