"""The serving draft against the training head, and the speculative loop against the target alone.

Heads are written in the native export format from `mtp_train.heads.MTPHead` (whose state dict
has exactly the format's tensor names) and loaded back through `inference_ref.draft.load_draft`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference_ref import speculative
from inference_ref.causal_lm import cu_seqlens_of, packed_positions
from inference_ref.draft import MTPDraft, load_draft
from inference_ref.generate import generate
from inference_ref.models.llama import LlamaModel, load_llama, random_llama
from inference_ref.skinny_linear import use_linear_kernel
from inference_ref.speculative import Chain, speculative_generate
from inference_ref.tree import TreeShape
from mtp_train.head_attention import Segments
from mtp_train.heads import HeadSpec, MTPHead
from tiny import assert_chains_match_training, frozen_of, randomized, rel_err, tiny_llama

VARIANTS = ["rmsnorm-restored", "eagle1"]

# ---------------------------------------------------------------- targets and heads for the tests


def small_target(context: float = 0.03, seed: int = 0) -> LlamaModel:
    """A 64-token Llama that is mostly a bigram model: with large embeddings and small attention and
    MLP outputs (scale `context`), the next token is mostly a function of the current one."""
    cfg = tiny_llama(
        vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, tie_word_embeddings=False
    )
    target = random_llama(cfg, seed=seed)
    with torch.no_grad():
        target.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.normal_(0, 1.0)
        for layer in target.layers:
            layer.self_attn.qkv_proj.weight.normal_(0, 0.3)
            layer.self_attn.o_proj.weight.normal_(0, context)
            layer.mlp.down_proj.weight.normal_(0, context)
    return target


def random_head(target: LlamaModel, variant: str, seed: int = 0, scale: float = 0.1) -> MTPHead:
    """Every trainable tensor random (norms around 1), so each part of the math shows in the output."""
    torch.manual_seed(seed)
    return randomized(MTPHead(HeadSpec(variant, target.cfg), frozen_of(target)), scale=scale)


def bigram_head(target: LlamaModel, variant: str, noise: float = 0.03, seed: int = 1) -> MTPHead:
    """A good but imperfect draft for `small_target`: fc passes the token's embedding through, so the
    head predicts the bigram successor of the token it reads; random `noise` everywhere else."""
    torch.manual_seed(seed)
    head = MTPHead(HeadSpec(variant, target.cfg), frozen_of(target))
    h = target.cfg.hidden_size
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, noise)
        head.fc.weight[:, :h] += torch.eye(h)
    return head


def export_native(
    head: MTPHead, out_dir: Path, stored: dict[str, torch.Tensor] | None = None, **config
) -> Path:
    """Write `head` in the native format (the export contract), optionally with stored tensors
    (`embed_tokens.weight`, `lm_head.weight`) and config.json fields overridden."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file({**tensors, **(stored or {})}, str(out_dir / "head.safetensors"))
    t = head.spec.target
    meta = {
        "format": "mtp-train-head",
        "format_version": 1,
        "architecture": "LlamaMTPHead",
        "variant": head.spec.variant,
        "dtype": "float32",
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "layer_config": {**t.to_hf(), "num_hidden_layers": 1},
        "shared_with_target": {"embed_tokens": "embed_tokens.weight" not in (stored or {}), "lm_head": True},
        "target": {
            "path": "",
            "config_hash": t.fingerprint(),
            "tokenizer_hash": None,
            "chat_template_hash": None,
        },
        "training": {},
    }
    (out_dir / "config.json").write_text(json.dumps({**meta, **config}))
    return out_dir


def serve(head: MTPHead, target: LlamaModel, tmp_path: Path) -> MTPDraft:
    return load_draft(export_native(head, tmp_path / "head"), target)


@pytest.fixture(scope="module")
def tiny(tiny_target) -> LlamaModel:
    return load_llama(tiny_target)


# ---------------------------------------------------------------- train/serve parity of the head


def training_outputs(
    head: MTPHead, hidden: torch.Tensor, tokens: torch.Tensor, lengths: list[int], steps: int
):
    """The training module's y [steps, T, H] and logits over packed sequences."""
    cu = cu_seqlens_of(lengths)
    with torch.no_grad():
        y = head(hidden, tokens, packed_positions(cu, hidden.shape[0]), Segments(cu, max(lengths)), steps)
        return y, head.logits(head.output_state(y))


def unpack(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[T, ...] packed → [B, max(lengths), ...] right-padded with zeros."""
    out = flat.new_zeros(len(lengths), max(lengths), *flat.shape[1:])
    for b, piece in enumerate(flat.split(lengths)):
        out[b, : len(piece)] = piece
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_logits_equal_training_head(variant, tiny, tmp_path):
    """The train/serve contract: draft prefill on a batch of target states = MTPHead, fp32, 1e-4."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, tiny.cfg.vocab_size, (n,), generator=g) for n in (21, 8, 33)]
    lengths = [len(s) for s in seqs]
    hidden, _ = tiny.forward_packed(torch.cat(seqs), cu_seqlens_of(lengths))
    # The draft at i reads (h_i, t_{i+1}); the last position's next token is arbitrary here (0).
    next_tokens = torch.cat([torch.cat([s[1:], s[:0].new_zeros(1)]) for s in seqs])
    head = random_head(tiny, variant)
    ref_y, ref_logits = training_outputs(head, hidden.clone(), next_tokens[None], lengths, steps=1)

    draft = serve(head, tiny, tmp_path)
    cache = draft.new_cache(len(seqs), max(lengths))
    y = draft.prefill(unpack(hidden, lengths), unpack(next_tokens, lengths), cache)
    mask = unpack(torch.ones(sum(lengths), dtype=torch.bool), lengths)
    assert rel_err(y[mask], ref_y[0]) <= 1e-4
    assert rel_err(draft.logits(y)[mask], ref_logits[0]) <= 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_chained_steps_equal_training_head(variant, tiny, tmp_path):
    """Chained drafting from several bases i at once (one batch row per base) = MTPHead's unrolled steps."""
    steps, n = 4, 16
    seq = torch.randint(0, tiny.cfg.vocab_size, (n + steps,), generator=torch.Generator().manual_seed(1))
    hidden, _ = tiny.forward_packed(seq[:n], cu_seqlens_of([n]))
    # Teacher-forced chain: depth j+1 at base i reads t_{i+1+j} (the drafted tokens along an accepted path).
    tokens = torch.stack([seq[1 + j : n + 1 + j] for j in range(steps)])
    head = random_head(tiny, variant, seed=1)
    ref_y, ref_logits = training_outputs(head, hidden.clone(), tokens, [n], steps)

    assert_chains_match_training(serve(head, tiny, tmp_path), hidden, tokens, ref_y, ref_logits)


def test_draft_prefill_alignment_on_five_tokens(tmp_path):
    """Hand-worked: prompt t_0 … t_4 and first token t_5. Draft entry i reads (h_i, t_{i+1}), so the
    draft's token row is t_1 … t_5 and its last entry's logits propose d_1 for position 6."""
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompt = [11, 22, 33, 44, 55]
    t5 = torch.tensor([7])
    hidden = target.forward_cached(torch.tensor([prompt]), target.new_cache(1, 5))
    cache, y_last = speculative.draft_prefill(draft, hidden, [prompt], t5, max_len=8)
    by_hand = draft.prefill(hidden, torch.tensor([[22, 33, 44, 55, 7]]), draft.new_cache(1, 8))
    assert cache.lengths.tolist() == [5]
    assert torch.equal(y_last, by_hand[:, 4])


def test_native_format_tensors_are_read_by_name(tiny, tmp_path):
    """Stored embeddings / lm_head replace the target's; the target's own stay untouched."""
    head = random_head(tiny, "rmsnorm-restored")
    g = torch.Generator().manual_seed(2)
    stored = {
        "embed_tokens.weight": torch.randn(tiny.cfg.vocab_size, tiny.cfg.hidden_size, generator=g),
        "lm_head.weight": torch.randn(tiny.cfg.vocab_size, tiny.cfg.hidden_size, generator=g),
    }
    before = tiny.embed_tokens.weight.clone()
    draft = load_draft(export_native(head, tmp_path / "head", stored), tiny)
    assert torch.equal(draft.embed_tokens.weight, stored["embed_tokens.weight"])
    assert torch.equal(draft.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(tiny.embed_tokens.weight, before)
    shared = serve(head, tiny, tmp_path / "shared")
    assert shared.embed_tokens is tiny.embed_tokens and shared.lm_head is tiny.lm_head


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": 128}, "hidden_size 128"),
        ({"vocab_size": 1000}, "vocab_size 1000"),
        ({"format": "eagle"}, "format 'eagle'"),
        ({"variant": "medusa"}, "variant 'medusa'"),
    ],
)
def test_refuses_a_head_that_does_not_fit(config, message, tiny, tmp_path):
    head = random_head(tiny, "eagle1")
    with pytest.raises(ValueError, match=message):
        load_draft(export_native(head, tmp_path / "head", **config), tiny)


# ---------------------------------------------------------------- greedy: identical to the target alone


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_equals_target_alone_with_a_good_draft(variant, tmp_path):
    """Rows accept different numbers of tokens at each step: per-row cache commits are exercised."""
    target = small_target()
    draft = serve(bigram_head(target, variant), target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1, 6, 30))
    eos = [5]  # a frequent token, so rows stop at different steps
    expected = generate(target, prompts, 40, eos)
    for k in (1, 2, 3, 4):
        out = speculative_generate(target, draft, prompts, 40, eos, Chain(k))
        assert out.tokens == expected, k
        assert out.stats.accept_rate[0] > 0.3 and out.stats.mean_accepted_len > 1.3


def test_the_graph_captured_step_run_eagerly_equals_target_alone(monkeypatch, tmp_path):
    """What a CUDA graph captures — the step with static (whole-cache, masked) attention and
    buffers updated in place — run eagerly on the CPU, where graphs do not exist."""
    from inference_ref.speculative import NO_CLOCK, SpecStep

    monkeypatch.setattr(SpecStep, "__call__", lambda self: self._run(NO_CLOCK, static=True))
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1, 6, 30))
    out = speculative_generate(target, draft, prompts, 40, [5], Chain(3))
    assert out.tokens == generate(target, prompts, 40, [5]) and out.stats.mean_accepted_len > 1.3


def test_host_work_is_timed_between_steps_and_not_the_steps(monkeypatch, tmp_path):
    """stats.host_s: from one step's results on the host to the next step's launch. A step made
    30 ms slower does not move it; 10 ms more of bookkeeping per step (in `emit`) does."""
    import time

    import inference_ref.speculative as spec
    from inference_ref.speculative import SpecStep

    run, emit = SpecStep.__call__, spec.emit
    monkeypatch.setattr(SpecStep, "__call__", lambda self: (time.sleep(0.03), run(self))[1])
    monkeypatch.setattr(spec, "emit", lambda *a: (time.sleep(0.01), emit(*a))[1])
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    stats = speculative_generate(target, draft, random_prompts(64, (3, 9)), 12, [], Chain(2)).stats
    assert stats.iterations >= 4 and 10 <= stats.host_ms_per_step < 25, (
        stats.iterations,
        stats.host_ms_per_step,
    )


def test_greedy_equals_target_alone_with_a_random_head(tiny, tmp_path):
    draft = serve(random_head(tiny, "rmsnorm-restored", scale=0.02), tiny, tmp_path)
    prompts = random_prompts(tiny.cfg.vocab_size, (5, 12, 2, 20))
    expected = generate(tiny, prompts, 24, tiny.cfg.eos_token_ids)
    for k in (1, 2, 3, 4):
        assert (
            speculative_generate(tiny, draft, prompts, 24, tiny.cfg.eos_token_ids, Chain(k)).tokens
            == expected
        )


def test_greedy_equals_target_alone_on_smollm2(smollm2, tmp_path):
    from transformers import AutoTokenizer

    target = load_llama(smollm2)
    draft = serve(random_head(target, "rmsnorm-restored", scale=0.02), target, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    questions = ["What is the capital of France?", "Name a color.", "Explain what a prime number is."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats
    ]
    eos = target.cfg.eos_token_ids
    expected = generate(target, prompts, 24, eos)
    for k in (1, 2, 3, 4):
        assert speculative_generate(target, draft, prompts, 24, eos, Chain(k)).tokens == expected, k


def count_along_greedy_path(logits, seq, prompt_len: int, max_new: int, tried: list, accepted: list) -> None:
    """Add to tried/accepted what a greedy loop would count on `seq` (the prompt and the target's
    greedy continuation), from teacher-forced draft logits [k, n, V]: draft j at base i proposes
    t_{i+2+j} and is accepted if it is the target's token; a step accepts the leading run."""
    k, n = logits.shape[:2]
    hits = logits.argmax(-1) == torch.stack([seq[2 + j : n + 2 + j] for j in range(k)])
    emitted, last = 1, prompt_len  # the prefill's token t_n; base i = last - 1
    while emitted < max_new:
        run = int(hits[:, last - 1].long().cumprod(0).sum())
        for j in range(min(run + 1, k)):
            tried[j] += 1
            accepted[j] += j < run
        emitted, last = emitted + run + 1, last + run + 1


def test_loop_acceptance_equals_teacher_forced_chain(tmp_path):
    """DESIGN: evaluating the chain on the target's greedy continuation, teacher-forcing the drafted
    tokens along the accepted path, gives the loop's greedy acceptance. Here the chain is evaluated by
    the training module, so this also checks refill alignment, chain positions and per-row commits."""
    k, max_new = 3, 30
    target = small_target()
    head = bigram_head(target, "rmsnorm-restored")
    prompts = random_prompts(64, (4, 11, 7))
    stats = speculative_generate(target, serve(head, target, tmp_path), prompts, max_new, [], Chain(k)).stats

    tried, accepted = [0] * k, [0] * k
    for prompt, more in zip(prompts, generate(target, prompts, max_new + k + 1, [])):
        seq = torch.tensor(prompt + more)
        n = len(seq) - k - 1
        hidden = target.forward_cached(seq[None, :n], target.new_cache(1, n))[0]
        tokens = torch.stack([seq[1 + j : n + 1 + j] for j in range(k)])
        _, logits = training_outputs(head, hidden.clone(), tokens, [n], steps=k)
        count_along_greedy_path(logits, seq, len(prompt), max_new, tried, accepted)
    assert (stats.tried, stats.accepted) == (tried, accepted)
    assert sum(accepted) > 20  # the draft is good enough for the comparison to mean something
    assert stats.emitted == stats.steps + sum(accepted)


# ---------------------------------------------------------------- sampling: the target's distribution


@torch.inference_mode()
def exact_joint(target: LlamaModel, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t_1, t_2, t_3 | prompt) [V, V, V] of the target sampled at `temperature`, by enumeration."""
    v, n = target.cfg.vocab_size, len(prompt)
    first, second = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(v * v, n), first.reshape(-1, 1), second.reshape(-1, 1)], 1)
    hidden = target.forward_cached(ids, target.new_cache(v * v, n + 2))
    p = torch.softmax(target.logits(hidden[:, n - 1 :]).double() / temperature, -1).reshape(v, v, 3, v)
    return p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]


def chi_square_pvalue(samples: list[list[int]], probs: torch.Tensor) -> float:
    """Goodness of fit of 3-token samples to probs [V, V, V]; cells expected < 5 times are pooled."""
    chisquare = pytest.importorskip("scipy.stats").chisquare

    v = probs.shape[0]
    counts = torch.zeros(v**3, dtype=torch.float64)
    index = torch.tensor([(a * v + b) * v + c for a, b, c in samples])
    counts.index_add_(0, index, torch.ones(len(samples), dtype=torch.float64))
    expected = probs.reshape(-1) * len(samples)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(
        chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    )


def sampled_run(k: int, temperature: float, draft: str, tmp_path: Path, runs: int = 4000):
    """`runs` independent samples of 3 tokens (one batch of copies of one prompt), with a `poor`
    draft (mostly rejected: residual draws) or a `fair` one (accepts, rejections and bonus tokens)."""
    target = small_target()
    head = (
        random_head(target, "rmsnorm-restored", seed=3, scale=0.3)
        if draft == "poor"
        else bigram_head(target, "eagle1")
    )
    prompt = [3, 14, 15, 9]
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target, serve(head, target, tmp_path), [prompt] * runs, 3, [], Chain(k), temperature, g
    )
    return out, exact_joint(target, prompt, temperature)


@pytest.mark.parametrize(
    "k, temperature, draft",
    [(1, 1.0, "poor"), (3, 1.0, "poor"), (1, 1.0, "fair"), (2, 1.0, "fair"), (3, 0.6, "fair")],
)
def test_sampling_preserves_the_target_distribution(k, temperature, draft, tmp_path):
    out, probs = sampled_run(k, temperature, draft, tmp_path)
    assert chi_square_pvalue(out.tokens, probs) > 1e-3


@pytest.mark.parametrize("draft", ["poor", "fair"])
def test_the_distribution_test_detects_a_wrong_sampler(draft, tmp_path, monkeypatch):
    """Control: resampling from p instead of norm(max(0, p − q)) after a rejection (a classic bug)
    over-weights the draft's choices, and the test above catches it."""
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    out, probs = sampled_run(2, 1.0, draft, tmp_path)
    assert chi_square_pvalue(out.tokens, probs) < 1e-3


@pytest.mark.parametrize("shape", [Chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_sampling_is_reproducible(shape, tmp_path):
    target = small_target()
    draft = serve(bigram_head(target, "eagle1"), target, tmp_path)
    prompts = random_prompts(64, (3, 8, 5))

    def run(seed: int):
        g = torch.Generator().manual_seed(seed)
        return speculative_generate(target, draft, prompts, 20, [], shape, 1.0, g).tokens

    assert run(0) == run(0) != run(1)


def test_padding_does_not_leak_into_the_draft(tmp_path):
    """A row's speculative output does not depend on which other rows share its batch."""
    target = small_target()
    draft = serve(bigram_head(target, "rmsnorm-restored"), target, tmp_path)
    prompts = random_prompts(64, (2, 19, 6))
    together = speculative_generate(target, draft, prompts, 25, [], Chain(3))
    alone = [speculative_generate(target, draft, [p], 25, [], Chain(3)) for p in prompts]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert together.stats.accepted == [sum(a.stats.accepted[j] for a in alone) for j in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_loop(dtype, tmp_path):
    """The same loop on CUDA: exact in fp32, running and reproducible (CUDA generator) in bf16."""
    target = small_target()
    head = bigram_head(target, "rmsnorm-restored")
    target = target.to("cuda", dtype)  # the rotary frequencies stay fp32
    assert target.rotary.inv_freq.dtype == torch.float32
    draft = serve(head, target, tmp_path)
    prompts = random_prompts(64, (3, 9, 17, 1, 6, 30))
    out = speculative_generate(target, draft, prompts, 40, [5], Chain(3))
    assert out.stats.mean_accepted_len > 1.3 and out.stats.target_s > 0
    graphed = speculative_generate(target, draft, prompts, 40, [5], Chain(3), graph=True)
    if dtype == torch.float32:
        assert out.tokens == generate(target, prompts, 40, [5]) == graphed.tokens
        assert graphed.stats.accepted == out.stats.accepted
    one = speculative_generate(target, draft, prompts[:1], 40, [5], Chain(3), graph=True)  # batch 1
    assert len(one.tokens[0]) > 0
    if dtype == torch.bfloat16:  # the graphed draft's maps through the skinny kernels, tuned in the warm-up
        use_linear_kernel("auto", in_graphs=True)
        try:
            skinny = speculative_generate(target, draft, prompts, 40, [5], Chain(3), graph=True)
        finally:
            use_linear_kernel("auto")
        assert skinny.stats.mean_accepted_len > 1.3

    def sampled(seed: int):
        g = torch.Generator("cuda").manual_seed(seed)
        return speculative_generate(target, draft, prompts, 20, [], Chain(3), 1.0, g).tokens

    assert sampled(0) == sampled(0)
    if dtype == torch.float32:  # the target's layers compiled: fused kernels, the same tokens
        target.compile_layers()
        fused = speculative_generate(target, draft, prompts, 40, [5], Chain(3), graph=True)
        assert fused.tokens == out.tokens and target.compile_proven == {"cached"}
