"""Parity of inference_ref's Llama with transformers' `LlamaForCausalLM` (fp32, CPU), and of its
packed and cached paths with each other."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from inference_ref import causal_lm
from inference_ref.causal_lm import cu_seqlens_of
from inference_ref.generate import generate, right_pad
from inference_ref.models.llama import (
    LlamaModel,
    RopeScaling,
    hf_state_dict,
    load_llama,
    random_llama,
)
from mtp_train.demo_target import smollm2_gguf
from tiny import rel_err, tiny_llama

TEXT = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
    "criticised its design, but it soon became a symbol of France, visited by millions every year."
)

TINY = dict(vocab_size=512, intermediate_size=160)
TINY_CONFIGS = {
    "gqa-tied": tiny_llama(**TINY),
    "mha-untied": tiny_llama(**TINY, num_key_value_heads=4, tie_word_embeddings=False),
    # original_max_position_embeddings far below the test's sequence length, so every band of the
    # llama3 scaling (divided, smoothed, kept) is exercised.
    "gqa-llama3-rope": tiny_llama(
        **TINY,
        tie_word_embeddings=False,
        num_hidden_layers=3,
        num_key_value_heads=1,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32),
    ),
}


def hf_twin(model: LlamaModel) -> transformers.LlamaForCausalLM:
    """transformers' model with this model's weights, built from `LlamaConfig.to_hf()`."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.cfg.to_hf()))
    state = hf_state_dict(model)
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied: the same tensor
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def hf_outputs(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed last hidden state, logits) for ids [B, S]."""
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def assert_matches_hf(model: LlamaModel, hf, ids: torch.Tensor) -> None:
    ref_hidden, ref_logits = hf_outputs(hf, ids)
    hidden = model.forward_cached(ids, model.new_cache(*ids.shape))
    with torch.inference_mode():
        assert rel_err(model.norm(hidden), ref_hidden) <= 1e-4
        assert rel_err(model.logits(hidden), ref_logits) <= 1e-4
    flat = ids.flatten()
    packed, logits = model.forward_packed(
        flat, cu_seqlens_of([ids.shape[1]] * ids.shape[0]), torch.arange(len(flat))
    )
    with torch.inference_mode():
        assert rel_err(model.norm(packed), ref_hidden.flatten(0, 1)) <= 1e-4
    assert rel_err(logits, ref_logits.flatten(0, 1)) <= 1e-4


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tiny_matches_transformers(name):
    cfg = TINY_CONFIGS[name]
    model = random_llama(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    assert_matches_hf(model, hf_twin(model), ids)


def test_llama3_rope_scaling_changes_the_output():
    """Guards the test above: with these settings the scaling is not a no-op."""
    cfg = TINY_CONFIGS["gqa-llama3-rope"]
    plain = dataclasses.replace(cfg, rope_scaling=None)
    scaled_model, plain_model = random_llama(cfg, seed=1), random_llama(plain, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    a = scaled_model.forward_cached(ids, scaled_model.new_cache(1, 150))
    b = plain_model.forward_cached(ids, plain_model.new_cache(1, 150))
    assert rel_err(a, b) > 1e-3  # well above the 1e-4 parity tolerance


@pytest.fixture(scope="module")
def smol(smollm2):
    return load_llama(smollm2)


def test_smollm2_matches_transformers(smollm2, smol):
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    assert_matches_hf(smol, hf, ids)


def test_packed_batch_equals_each_sequence_alone():
    model = random_llama(TINY_CONFIGS["gqa-llama3-rope"], seed=2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in (7, 40, 1, 23)]
    packed, _ = model.forward_packed(torch.cat(seqs), cu_seqlens_of([len(s) for s in seqs]))
    alone = [model.forward_packed(s, cu_seqlens_of([len(s)]))[0] for s in seqs]
    assert rel_err(packed, torch.cat(alone)) <= 1e-5


def test_padded_cached_batch_equals_each_sequence_alone():
    model = random_llama(TINY_CONFIGS["gqa-tied"], seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 30, 2)]
    ids, lengths = right_pad(prompts, "cpu")
    batched = model.forward_cached(ids, model.new_cache(len(prompts), ids.shape[1]))
    for b, p in enumerate(prompts):
        alone = model.forward_packed(torch.tensor(p), cu_seqlens_of([len(p)]))[0]
        assert rel_err(batched[b, : lengths[b]], alone) <= 1e-5


def test_incremental_decode_equals_full_forward():
    """Prefill, then steps of 1 and 3 tokens at per-row offsets: the cache path of decoding and verifying."""
    model = random_llama(TINY_CONFIGS["gqa-llama3-rope"], seed=4)
    full = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(2))
    ref = model.forward_cached(full, model.new_cache(2, 48))
    cache = model.new_cache(2, 48)
    model.forward_cached(full[:, :20], cache)
    cache.lengths = torch.tensor([20, 17])  # row 1's entries 17…19 are scratch and get rewritten
    while int(cache.lengths.max()) < 44:
        step = 1 if int(cache.lengths[0]) % 2 else 3
        cols = cache.lengths[:, None] + torch.arange(step)
        out = model.forward_cached(full.gather(1, cols), cache)
        for b in range(2):
            assert rel_err(out[b], ref[b, cols[b]]) <= 1e-5
        cache.lengths += step


def test_gguf_loader_equals_converted_directory(smollm2, smol):
    """`load_target` on the .gguf file (through `gguf.load_gguf`) builds the converted directory's model."""
    from inference_ref.target import load_target

    from_gguf = load_target(smollm2_gguf())
    assert from_gguf.cfg == smol.cfg
    ours, theirs = from_gguf.state_dict(), smol.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    a = from_gguf.forward_cached(ids, from_gguf.new_cache(1, 6))
    b = smol.forward_cached(ids, smol.new_cache(1, 6))
    assert torch.equal(a, b)


def test_converted_directory_holds_what_transformers_reads_from_the_gguf(smollm2):
    """The converted directory every stage loads (our GGUF reader: names, q/k rows un-interleaved,
    layout) against transformers' own GGUF loader, which reads the file its own way (both
    de-quantize with the `gguf` package's `dequantize`)."""
    from safetensors.torch import load_file

    gguf = smollm2_gguf()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    theirs = hf.state_dict()
    ours = load_file(str(smollm2 / "model.safetensors"))
    assert ours.keys() == theirs.keys() - {"lm_head.weight"}  # tied to the embedding, stored once
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def fake_compile(works_for: int):
    """A torch.compile stand-in whose function runs eager `works_for` times, then raises."""
    calls = []

    def compile(fn, **options):
        def run(*args):
            calls.append(1)
            if len(calls) > works_for:
                raise RuntimeError("no C++ compiler")
            return fn(*args)

        return run

    return compile


@pytest.fixture
def tiny_compiled(monkeypatch):
    """A 2-layer model and its eager states; torch.compile replaced by the test (and the
    process-wide compiled function rebuilt from it, then dropped)."""
    model = random_llama(TINY_CONFIGS["gqa-tied"])
    ids, cu = torch.randint(0, 512, (30,)), cu_seqlens_of([12, 18])
    eager, _ = model.forward_packed(ids, cu)
    causal_lm.compiled.cache_clear()
    yield model, ids, cu, eager
    causal_lm.compiled.cache_clear()


def test_layers_that_cannot_compile_run_eager_and_say_so(tiny_compiled, monkeypatch):
    """A toolchain that cannot compile (no compiler, an Inductor error) costs the fusion, not the
    run: the first call warns and the same states come out of the eager layers."""
    model, ids, cu, eager = tiny_compiled
    monkeypatch.setattr(torch, "compile", fake_compile(works_for=0))
    model.compile_layers()
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        again, _ = model.forward_packed(ids, cu)
    assert torch.equal(again, eager) and not model.runs_compiled("packed")


def test_compiled_layers_that_ran_once_raise_their_errors(tiny_compiled, monkeypatch):
    """Once the compiled layers have run, an error is the run's, not the toolchain's: it is
    raised, not hidden by a switch to eager halfway through a store."""
    model, ids, cu, eager = tiny_compiled
    monkeypatch.setattr(torch, "compile", fake_compile(works_for=3))
    model.compile_layers()
    first, _ = model.forward_packed(ids, cu)  # two layers: calls 1 and 2
    assert torch.equal(first, eager)
    with pytest.raises(RuntimeError, match="no C"):
        model.forward_packed(ids, cu)  # call 4 fails


def test_decoding_runs_the_compiled_cached_forward(monkeypatch):
    """With compiled layers the cached forward (prefill and every decode step) goes through the
    compiled function. A compile failure there sends the cached forward to eager even after the
    packed forward has compiled and run, and leaves the packed forward compiled."""
    model = random_llama(TINY_CONFIGS["gqa-tied"])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    eager = generate(model, prompts, 6, eos_ids=[])
    calls = []

    def counting_compile(fn, **options):
        def run(*args):
            calls.append(fn.__name__)
            return fn(*args)

        return run

    causal_lm.compiled.cache_clear()
    try:
        monkeypatch.setattr(torch, "compile", counting_compile)
        model.compile_layers()
        assert generate(model, prompts, 6, eos_ids=[]) == eager
        assert calls == ["cached_layer_forward"] * 2 * 6  # 2 layers × (prefill + 5 steps)
        model.forward_packed(torch.randint(0, 512, (10,)), cu_seqlens_of([4, 6]))
        assert model.compile_proven == {"packed", "cached"}

        model.compile_layers()
        model.forward_packed(torch.randint(0, 512, (10,)), cu_seqlens_of([4, 6]))  # proven
        causal_lm.compiled.cache_clear()  # rebuilt from the failing compile below
        monkeypatch.setattr(torch, "compile", fake_compile(works_for=0))
        with pytest.warns(UserWarning, match="compiled cached layers .* no C\\+\\+ compiler") as caught:
            assert generate(model, prompts, 6, eos_ids=[]) == eager
        assert caught[0].filename.endswith("generate.py")  # it names the forward's caller
        assert not model.runs_compiled("cached") and model.runs_compiled("packed")
    finally:
        causal_lm.compiled.cache_clear()
