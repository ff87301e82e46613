"""The cached attention's FlexAttention kernel (`use_cached_kernel("flex")`, #36) computes what
SDPA computes: for a chain's masks (per-row lengths, one and several new tokens) through a whole
model's incremental decode, and for an arbitrary mask (a token tree's) on the kernel alone."""

from __future__ import annotations

import pytest
import torch

from inference_ref import attention
from inference_ref.attention import cached_attention, flex_cached_attention, use_cached_kernel
from inference_ref.generate import generate
from inference_ref.models.llama import random_llama
from tiny import rel_err, tiny_llama


@pytest.fixture
def flex():
    use_cached_kernel("flex")
    yield
    use_cached_kernel("sdpa")


@pytest.mark.parametrize("static", [False, True])
def test_incremental_decode_with_flex_equals_sdpa(flex, static):
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
    with pytest.raises(ValueError, match="'flash'.*sdpa, flex"):
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


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_compiled_decoding_specializes_the_batch_for_flex_only(kernel):
    """FlexAttention's decoding kernel needs the batch static in the graph (`attention.static_batch`):
    with flex, compiled cached layers compile again for each new batch size and reuse a batch
    size's graphs; with SDPA, once the batch is dynamic a new batch size compiles nothing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    use_cached_kernel(kernel)
    try:
        model = random_llama(tiny_llama(num_attention_heads=6, num_key_value_heads=2), seed=4)
        model.compile_layers()
        new_graphs = []
        for batch in (2, 3, 4, 3):
            before = counters["stats"]["unique_graphs"]
            generate(model, [[1, 2, 3, 4]] * batch, 3, eos_ids=[])
            new_graphs.append(counters["stats"]["unique_graphs"] - before)
    finally:
        use_cached_kernel("sdpa")
    assert new_graphs[0] > 0 and new_graphs[3] == 0  # compiled once per batch size at most
    assert (new_graphs[2] > 0) == (kernel == "flex")  # batch 4: a graph of its own only for flex
