"""The cached attention's FlexAttention kernel (`use_cached_kernel("flex")`, #36) computes what
SDPA computes: for a chain's masks (per-row lengths, one and several new tokens) through a whole
model's incremental decode, and for an arbitrary mask (a token tree's) on the kernel alone. "mixed"
(the CUDA default) decodes with SDPA and verifies with flex, in the same compiled layers."""

from __future__ import annotations

import pytest
import torch

from inference_ref import attention
from inference_ref.attention import cached_attention, flex_cached_attention, kernel_for, use_cached_kernel
from inference_ref.generate import generate
from inference_ref.models.llama import random_llama
from tiny import rel_err, tiny_llama


@pytest.fixture
def flex():
    use_cached_kernel("flex")
    yield
    use_cached_kernel("auto")


@pytest.mark.parametrize(
    "kernel, new, device, compiled, runs",
    [
        ("auto", 1, "cuda", True, "sdpa"),  # decoding
        ("auto", 2, "cuda", True, "flex"),  # verifying
        ("auto", 8, "cuda", True, "flex"),
        ("auto", 9, "cuda", True, "sdpa"),  # a prefill, a large tree: not measured against SDPA
        ("auto", 4, "cuda", False, "sdpa"),  # eager layers: flex measured only with a dynamic batch
        ("auto", 4, "cpu", True, "sdpa"),
        ("mixed", 4, "cpu", False, "flex"),
        ("mixed", 1, "cpu", True, "sdpa"),
        ("flex", 1, "cuda", False, "flex"),
        ("sdpa", 4, "cuda", True, "sdpa"),
    ],
)
def test_kernel_choice(kernel, new, device, compiled, runs):
    assert kernel_for(new, device, compiled, kernel) == runs


@pytest.mark.parametrize("kernel", ["flex", "mixed"])
@pytest.mark.parametrize("static", [False, True])
def test_incremental_decode_with_flex_equals_sdpa(flex, kernel, static):
    """Prefill, then steps of 1 and 3 tokens at per-row offsets (row 1's later entries scratch, to be
    rewritten), each step's states against the same steps through SDPA; `static`: the steps attend
    over the whole cache, masked, as a captured CUDA graph's do."""
    model = random_llama(tiny_llama(num_attention_heads=6, num_key_value_heads=2), seed=4)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))

    def decode() -> list[torch.Tensor]:
        cache = model.new_cache(2, 40)
        outs = [model.forward_cached(tokens[:, :16], cache)]
        cache.lengths = torch.tensor([16, 13])
        while int(cache.lengths.max()) < 36:
            step = 1 if int(cache.lengths[0]) % 2 else 3
            ids = tokens.gather(1, cache.lengths[:, None] + torch.arange(step))
            outs.append(model.forward_cached(ids, cache, static=static))
            cache.lengths += step
        return outs

    use_cached_kernel(kernel)  # mixed: the 16-token prefill and 1-token steps SDPA's, 3-token steps flex's
    with_flex = decode()
    use_cached_kernel("sdpa")
    for ours, sdpa in zip(with_flex, decode(), strict=True):
        assert rel_err(ours, sdpa) <= 1e-5


def test_flex_kernel_takes_any_mask():
    """A tree's mask (each node sees the committed entries and some of the scratch ones), GQA
    groups of 3: the kernel, compiled as `cached_attention` runs it, against SDPA."""
    g = torch.Generator().manual_seed(0)
    batch, new, keys = 2, 5, 96
    q = torch.randn(batch, new, 6, 16, generator=g)
    k, v = (torch.randn(batch, keys, 2, 16, generator=g) for _ in "kv")
    mask = torch.rand(batch, 1, new, keys, generator=g) < 0.5
    mask[..., :10] = True  # every query sees something
    want = cached_attention(q, k, v, mask)
    assert rel_err(attention._flex_compiled(q, k, v, mask), want) <= 1e-5
    assert rel_err(flex_cached_attention(q, k, v, mask), want) <= 1e-5  # eager, as a check


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="'flash'.*auto, sdpa, flex, mixed"):
        use_cached_kernel("flash")


def test_flex_runs_inside_compiled_layers(flex):
    """Compiled cached layers trace the flex kernel inline and decode what eager SDPA decodes."""
    model = random_llama(tiny_llama(num_attention_heads=6, num_key_value_heads=2), seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    use_cached_kernel("sdpa")
    eager = generate(model, prompts, 6, eos_ids=[])
    use_cached_kernel("flex")
    model.compile_layers()
    assert generate(model, prompts, 6, eos_ids=[]) == eager
    assert model.compile_proven == {"cached"}


def test_mixed_specializes_the_batch_of_verify_steps_only():
    """ "mixed" in compiled layers: a one-token step (SDPA) at a new batch size reuses the dynamic
    graph; a three-token step (flex) at a new batch size compiles one of its own (FlexAttention's
    decoding kernel needs the batch static in the graph: `attention.static_batch`) and reuses it at
    that batch size again; each step's states are eager SDPA's. ("flex" everywhere specializes its
    one-token steps the same way; a test of its own took 37 s of the suite, 2026-12-07.)"""
    from torch._dynamo.utils import counters

    model = random_llama(tiny_llama(num_attention_heads=6, num_key_value_heads=2), seed=4)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))

    def step_states(batch: int) -> list[torch.Tensor]:
        cache = model.new_cache(batch, 16)
        cache.lengths = torch.full((batch,), 12)
        return [model.forward_cached(tokens[:batch, 12 : 12 + n], cache) for n in (1, 3)]

    batches = (2, 3, 4)  # the first graphs specialize on batch 2; by batch 4 a dynamic batch is proven
    want = {batch: step_states(batch) for batch in batches}
    batches += (3,)  # a batch size seen before: nothing compiles
    torch._dynamo.reset()
    use_cached_kernel("mixed")
    try:
        model.compile_layers()
        new_graphs = {}
        for batch in batches:
            before = counters["stats"]["unique_graphs"]
            cache = model.new_cache(batch, 16)
            cache.lengths = torch.full((batch,), 12)
            for n, expected in zip((1, 3), want[batch]):
                ours = model.forward_cached(tokens[:batch, 12 : 12 + n], cache)
                assert rel_err(ours, expected) <= 1e-5
                new_graphs[batch, n] = counters["stats"]["unique_graphs"] - before
                before = counters["stats"]["unique_graphs"]
    finally:
        use_cached_kernel("auto")
    assert new_graphs[2, 1] > 0 and new_graphs[2, 3] > 0  # the first of each compiles
    assert new_graphs[4, 1] == 0  # decoding: the batch is dynamic
    assert new_graphs[4, 3] > 0  # verifying: a graph per batch size, for flex's decoding kernel
    assert new_graphs[3, 1] == new_graphs[3, 3] == 0  # batch 3 again (the last pass's counts): reused
