"""Tensor parallelism (`inference_ref.tensor_parallel`): the sharded target against the whole one
in two real processes (gloo on CPU), the row interleaving, the refusals and the memory check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_ref.models.llama import LlamaConfig
from inference_ref.tensor_parallel import (
    GiB,
    check_shardable,
    fit_error,
    interleave_rows,
    weight_bytes_per_rank,
)
from tiny import tiny_deepseek, tiny_llama

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

LLAMA_70B = LlamaConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
)


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*TORCHRUN, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_two_way_sharded_target_equals_the_whole_one(tmp_path):
    """fp32: the packed states and logits within 1e-5 (relative), greedy generation token-identical,
    the speculative loop's tokens and its acceptance counts (verify steps, drafts tried and accepted
    per position) identical, for an untied target (vocab-parallel embedding and lm_head) and a
    tied one (replicated table)."""
    torchrun("tests/tensor_parallel_worker.py", str(tmp_path / "result.json"))
    results = json.loads((tmp_path / "result.json").read_text())
    assert set(results) == {"untied", "tied"}
    for figures in results.values():
        assert figures["hidden_rel_err"] <= 1e-5 and figures["logits_rel_err"] <= 1e-5
        assert figures["generate_equal"]
        for k in ("k1", "k3"):
            assert figures[k]["tokens_equal"]
            assert figures[k]["counts_sharded"] == figures[k]["counts_whole"]
    assert results["untied"]["k3"]["counts_whole"][2][0] < results["untied"]["k3"]["counts_whole"][1][0]


def test_interleaved_rows_give_each_rank_its_part_of_every_block():
    q, k, v = torch.arange(8), 100 + torch.arange(4), 200 + torch.arange(4)
    fused = torch.cat([q, k, v])[:, None]
    parts = interleave_rows(fused, [8, 4, 4], 2).chunk(2)
    assert parts[0].flatten().tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert parts[1].flatten().tolist() == [4, 5, 6, 7, 102, 103, 202, 203]


def test_refuses_what_it_cannot_shard():
    with pytest.raises(ValueError, match="not deepseek_v2.*model.tp_size=1"):
        check_shardable(tiny_deepseek(), 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(tiny_llama(), 4)  # 2 KV heads
    check_shardable(tiny_llama(), 2)


def test_weight_bytes_per_rank_at_the_70b_shape():
    """70.6B weights: 141 GB in bf16 whole; at TP 2 each rank holds half of every linear map and
    of both vocabulary tables, and the norms whole."""
    whole = weight_bytes_per_rank(LLAMA_70B, 1, 2)
    assert abs(whole / 1e9 - 141.1) < 0.2
    norms = (2 * LLAMA_70B.num_hidden_layers + 1) * LLAMA_70B.hidden_size * 2
    assert weight_bytes_per_rank(LLAMA_70B, 2, 2) == pytest.approx((whole - norms) / 2 + norms, rel=1e-9)


def test_a_target_that_does_not_fit_is_refused_with_the_override_that_would():
    h100 = 80 * GiB
    error = fit_error(LLAMA_70B, 1, 2, free=int(79 * GiB), total=h100, headroom=0.1, fp8=False)
    assert "131.4 GiB per GPU at model.tp_size=1" in error and "use model.tp_size=2" in error
    assert fit_error(LLAMA_70B, 2, 2, free=int(79 * GiB), total=h100, headroom=0.1, fp8=False) is None
    error = fit_error(LLAMA_70B, 2, 2, free=int(79 * GiB), total=h100, headroom=0.3, fp8=False)
    assert "65.7 GiB per GPU at model.tp_size=2" in error and "use model.tp_size=4" in error
    assert "model.quantization=fp8" not in error  # FP8 runs in one process only


def test_fp8_weight_bytes_count_what_loading_holds_at_the_70b_shape():
    """FP8: the layers' maps at a byte and a scale per row, the vocabulary tables and norms in bf16,
    and while loading one layer's maps more in bf16, with two fp32 temporaries of its fused gate|up map
    (`quantization.quantize_onto`), counted here from the shape by hand."""
    h, i, kv, layers, vocab = 8192, 28672, 1024, 80, 128256
    maps = h * h + 2 * kv * h + h * h + 2 * i * h + h * i  # q, k, v, o, gate|up, down
    rows = h + 2 * kv + h + 2 * i + h  # their output channels, one fp32 scale each
    norms = 2 * h
    want = layers * (maps + 4 * rows + 2 * norms) + 2 * (2 * vocab * h + h)  # held
    want += 2 * maps + 2 * 4 * (2 * i * h)  # loading: a layer's maps in bf16, fp32 temporaries
    assert weight_bytes_per_rank(LLAMA_70B, 1, 2, fp8=True) == pytest.approx(want, rel=1e-6)


def test_fp8_is_offered_in_one_process_and_left_for_more_ranks_when_it_does_not_fit():
    h200 = 140 * GiB
    error = fit_error(LLAMA_70B, 1, 2, free=int(139 * GiB), total=h200, headroom=0.1, fp8=False)
    assert "use model.tp_size=2 (launch that many processes) or model.quantization=fp8" in error
    error = fit_error(LLAMA_70B, 1, 2, free=int(79 * GiB), total=80 * GiB, headroom=0.2, fp8=True)
    assert "72.8 GiB per GPU at model.tp_size=1" in error
    assert "use model.quantization=none with model.tp_size=4" in error  # 32.9 GiB in bf16 at TP 4


def test_tp_size_without_a_launch_says_how_to_launch(tiny_target):
    from omegaconf import OmegaConf

    from mtp_train.config import RunConfig
    from mtp_train.run import resolve_run

    cfg = OmegaConf.structured(RunConfig)
    cfg.model.name, cfg.model.target, cfg.model.tp_size = "tiny", str(tiny_target), 2
    with pytest.raises(ValueError, match="needs a multiple of 2 processes.*--num_processes 2"):
        resolve_run(cfg.model, sharded_as="mtp_train.validate")


def test_a_tied_vocabulary_table_is_counted_once():
    untied = weight_bytes_per_rank(tiny_llama(tie_word_embeddings=False), 1, 2)
    tied = weight_bytes_per_rank(tiny_llama(tie_word_embeddings=True), 1, 2)
    cfg = tiny_llama()
    assert untied - tied == 2 * cfg.vocab_size * cfg.hidden_size


def test_fp8_weighs_less_than_bf16_with_experts_kept_in_bf16():
    """Qwen3-30B-A3B's shape: its experts are stacked tensors that stay bf16, so FP8 saves only
    the attention maps; loading adds a layer's maps, not its experts."""
    from benchmarks.common import shape

    cfg = shape("qwen3_30b_a3b")
    assert weight_bytes_per_rank(cfg, 1, 2, fp8=True) < weight_bytes_per_rank(cfg, 1, 2)


def test_a_decode_step_reads_every_weight_but_the_embedding_rows_plus_its_kv_cache():
    """#36's bar is a share of the bandwidth a decode step needs: at the 8B shape, batch 1, a
    1,024-token cache, 15.14 GB (the 16.06 GB of weights, less the 1.05 GB embedding table a step
    only gathers from, plus 134 MB of K and V), counted by hand from the shape."""
    from benchmarks.bench_verify_cost import decode_read_limits
    from benchmarks.common import decode_read_bytes, shape

    cfg = shape("llama3_8b")
    h, kv, inter, layers, vocab = 4096, 8 * 128, 14336, 32, 128256
    layer = h * (h + 2 * kv) + h * h + 3 * h * inter + 2 * h
    weights = 2 * (layers * layer + vocab * h + h)  # one vocabulary table (the lm_head), the final norm
    cache = layers * 2 * 1024 * kv * 2
    assert decode_read_bytes(cfg, 1, 1024) == weights + cache == 15_144_067_072
    assert decode_read_bytes(cfg, 8, 1024) == weights + 8 * cache
    tied = shape("llama3_8b", tie_word_embeddings=True)
    assert decode_read_bytes(tied, 1, 1024) == decode_read_bytes(cfg, 1, 1024)  # the table, read once
    assert decode_read_bytes(shape("qwen3_30b_a3b"), 1, 1024) is None  # MoE reads its routed experts only
    limits = decode_read_limits(cfg, {"1": {"1": 4.93, "2": 5.0}}, "NVIDIA H200")
    assert limits["1"]["limit_ms"] == pytest.approx(15_144_067_072 / 4.8e12 * 1e3)
    assert limits["1"]["share_of_peak"] == pytest.approx(0.640, abs=1e-3)
    assert decode_read_limits(cfg, {"1": {"1": 4.93}}, "NVIDIA GeForce RTX 4090") is None
