"""Checks of the Triton kernels (`inference_ref.split_kv_attention`, `inference_ref.skinny_linear`)
against PyTorch's own, for a device and dtype: on a CPU under Triton's interpreter
(`test_triton_kernels.py` runs them in a child process with TRITON_INTERPRET=1, which Triton reads
when the kernels are defined) and on CUDA in bf16 (`test_gpu.py`).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernel_checks.py split_kv cpu float32
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch
import torch.nn.functional as F

import inference_ref.skinny_linear as skinny
from inference_ref.attention import cache_mask, use_cached_kernel
from inference_ref.causal_lm import allow_compiled_variants, rms_norm
from inference_ref.models.llama import apply_rotary, random_llama
from inference_ref.models.qwen3 import Qwen3Config, random_qwen3
from inference_ref.skinny_linear import qkv_rope_cache, silu_gate_up, skinny_linear, use_linear_kernel
from inference_ref.split_kv_attention import split_kv_attention
from tiny import tiny_llama


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.isfinite().all(), "non-finite output"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def check_split_kv(device: str, dtype: torch.dtype) -> None:
    """Random rows of random lengths; every new token against SDPA over its visible keys in fp64."""
    torch.manual_seed(0)
    cases = [  # batch, new tokens, query heads, K/V heads, cache capacity, head size
        (1, 1, 8, 2, 100, 64),
        (3, 4, 8, 2, 300, 64),
        (2, 8, 4, 4, 70, 32),
        (2, 2, 12, 4, 200, 64),
        (4, 16, 4, 1, 90, 16),
    ]
    if device == "cuda":
        cases += [(1, 1, 32, 8, 1089, 128), (8, 8, 32, 8, 1089, 128)]
    for batch, new, heads, kv_heads, capacity, dim in cases:
        q = torch.randn(batch, new, heads, dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, capacity, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
        lengths = torch.randint(0, capacity - new + 1, (batch,), device=device)
        got = split_kv_attention(q, k, v, lengths)
        want = F.scaled_dot_product_attention(
            *(t.transpose(1, 2).double() for t in (q, k, v)),
            attn_mask=cache_mask(lengths, new, capacity),
            enable_gqa=True,
        ).transpose(1, 2)
        err = relative_error(got, want)
        assert err < tolerance(dtype), (batch, new, heads, kv_heads, capacity, lengths.tolist(), err)
    # q with its head size strided (the op copies it), and the op against its fake (strides too)
    q = torch.randn(2, 3, 64, 8, device=device, dtype=dtype).transpose(-1, -2)
    k, v = (torch.randn(2, 50, 2, 64, device=device, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([0, 47], device=device)
    got = split_kv_attention(q, k, v, lengths)
    assert got.is_contiguous()
    assert relative_error(got, split_kv_attention(q.contiguous(), k, v, lengths)) == 0
    torch.library.opcheck(
        split_kv_attention, (q, k, v, lengths), test_utils=("test_schema", "test_faketensor")
    )


def check_skinny(device: str, dtype: torch.dtype) -> None:
    """Rows 1–64 (leading dimensions kept), features not multiples of the tiles; plain and gated
    (silu(gate) · up of x = [gate | up], against the activation rounded to the dtype, as it is
    before the map), with and without a residual added, with and without the RMSNorm before it."""
    torch.manual_seed(0)
    cases = [
        ((1, 1, 96), 40),
        ((3, 5, 64), 33),
        ((64, 128), 48),
        ((2, 100), 17),
        ((7, 256), 520),
        ((1, 4096), 24),
    ]
    for x_shape, out_features in cases:
        x = torch.randn(*x_shape, device=device, dtype=dtype)
        w = torch.randn(out_features, x_shape[-1], device=device, dtype=dtype)
        got = skinny_linear(x, w)
        assert got.shape == (*x_shape[:-1], out_features)
        err = relative_error(got, F.linear(x.double(), w.double()))
        assert err < tolerance(dtype), (x_shape, out_features, err)
        residual = torch.randn(*x_shape[:-1], out_features, device=device, dtype=dtype)
        err = relative_error(
            skinny_linear(x, w, False, residual), F.linear(x.double(), w.double()) + residual
        )
        assert err < tolerance(dtype), ("residual", x_shape, out_features, err)
        g = 1 + 0.5 * torch.randn(x_shape[-1], device=device, dtype=dtype)
        if x.numel() > x.shape[-1]:  # the norm: one row only
            try:
                skinny_linear(x, w, False, None, g, 1e-5)
            except ValueError:
                continue
            raise AssertionError(f"skinny_linear normed {x_shape}: one row only")
        normed = F.linear(rms_norm(3 * x.double(), g.double(), 1e-5), w.double())
        for r in (None, residual):
            got = skinny_linear(3 * x, w, False, r, g, 1e-5)
            err = relative_error(got, normed if r is None else normed + r)
            assert err < tolerance(dtype), ("norm", r is None, x_shape, out_features, err)
    for features, out_features in ((96, 40), (4096, 24), (100, 17)):  # gated: one row
        gate_up = torch.randn(1, 1, 2 * features, device=device, dtype=dtype)
        w = torch.randn(out_features, features, device=device, dtype=dtype)
        gate, up = gate_up.double().chunk(2, dim=-1)
        activation = (F.silu(gate) * up).to(dtype).double()
        err = relative_error(skinny_linear(gate_up, w, True), F.linear(activation, w.double()))
        assert err < tolerance(dtype), ("gated", features, out_features, err)
        residual = torch.randn(1, 1, out_features, device=device, dtype=dtype)
        want = F.linear(activation, w.double()) + residual
        err = relative_error(skinny_linear(gate_up, w, True, residual), want)
        assert err < tolerance(dtype), ("gated, residual", features, out_features, err)
    for x_shape, features in (((3, 5, 64), 40), ((64, 96), 24), ((2, 100), 8)):  # a tile: silu_gate_up
        x = torch.randn(*x_shape, device=device, dtype=dtype)
        w = torch.randn(2 * features, x_shape[-1], device=device, dtype=dtype) / x_shape[-1] ** 0.5
        gate, up = F.linear(x.double(), w.double()).to(dtype).double().chunk(2, dim=-1)
        got = silu_gate_up(x, w)
        assert got.shape == (*x_shape[:-1], features)
        err = relative_error(got, F.silu(gate) * up)
        assert err < tolerance(dtype), ("silu_gate_up", x_shape, features, err)
    check_split_norm(device, dtype)
    x, w = torch.randn(3, 40, device=device, dtype=dtype), torch.randn(24, 40, device=device, dtype=dtype)
    torch.library.opcheck(silu_gate_up, (x, torch.randn(32, 40, device=device, dtype=dtype)))
    torch.library.opcheck(skinny_linear, (x, w), test_utils=("test_schema", "test_faketensor"))
    gate_up = torch.randn(1, 80, device=device, dtype=dtype)
    torch.library.opcheck(skinny_linear, (gate_up, w, True), test_utils=("test_schema", "test_faketensor"))
    residual = torch.randn(3, 24, device=device, dtype=dtype)
    torch.library.opcheck(
        skinny_linear, (x, w, False, residual), test_utils=("test_schema", "test_faketensor")
    )
    g = torch.randn(40, device=device, dtype=dtype)
    torch.library.opcheck(
        skinny_linear, (x[:1], w, False, None, g, 1e-6), test_utils=("test_schema", "test_faketensor")
    )


def check_split_norm(device: str, dtype: torch.dtype, shape: dict | None = None) -> int:
    """A tile's RMSNorm split between two maps (`skinny_linear_norm_out`, then `skinny_linear`'s,
    `silu_gate_up`'s or `qkv_rope_cache`'s squares): h = r + x · w, h · g and h's sums of squares
    by 16 features, and the next maps of the normed h, against PyTorch's in fp64 (h rounded to the dtype first, as the
    norm's input is). `shape`: forced on every map (`check_block_shape`). Returns the maps run."""
    torch.manual_seed(3)
    cases = [((3, 5, 64), 48, 40), ((2, 96), 80, 24)] if shape is None else [((9, 64), 80, 128)]
    maps = 3 * len(cases)
    for x_shape, hidden, out_features in cases:
        x = torch.randn(*x_shape, device=device, dtype=dtype) / x_shape[-1] ** 0.5
        w = torch.randn(hidden, x_shape[-1], device=device, dtype=dtype)
        r = torch.randn(*x_shape[:-1], hidden, device=device, dtype=dtype)
        g = 1 + 0.5 * torch.randn(hidden, device=device, dtype=dtype)
        h, scaled, squares = skinny.skinny_linear_norm_out(x, w, r, g)
        want = F.linear(x.double(), w.double()) + r
        assert relative_error(h, want) < tolerance(dtype), ("norm_out", x_shape, relative_error(h, want))
        hd = h.double().reshape(-1, hidden)
        assert relative_error(scaled, h.double() * g.double()) < tolerance(dtype), ("h · g", x_shape)
        sums = (hd * hd).unflatten(1, (-1, 16)).sum(-1).T
        assert squares.shape == sums.shape and relative_error(squares, sums) < 1e-5, ("squares", x_shape)
        w_next = torch.randn(2 * out_features, hidden, device=device, dtype=dtype) / hidden**0.5
        normed = F.linear(rms_norm(h.double(), g.double(), 1e-5), w_next.double())
        got = skinny_linear(scaled, w_next, squares=squares, eps=1e-5)
        assert relative_error(got, normed) < tolerance(dtype), (
            "scaled",
            x_shape,
            relative_error(got, normed),
        )
        gate, up = normed.to(dtype).double().chunk(2, dim=-1)
        got = silu_gate_up(scaled, w_next, squares, 1e-5)
        err = relative_error(got, F.silu(gate) * up)
        assert err < tolerance(dtype), ("scaled silu_gate_up", x_shape, err)
        if shape is None or skinny.holds_rotary_pairs(shape, 32):  # q|k|v of the normed h (the next layer's)
            batch, new = x_shape[:-1] if len(x_shape) == 3 else (1, x_shape[0])
            w_qkv = torch.randn(4 * 32, hidden, device=device, dtype=dtype) / hidden**0.5  # 2 + 2 · 1 heads
            cos, sin = rotary_tables(batch, new, 32, device, dtype)
            k_cache, v_cache = (torch.zeros(batch, new, 1, 32, device=device, dtype=dtype) for _ in "kv")
            slots = torch.arange(new, device=device).expand(batch, new)
            h_rows = h.reshape(batch, new, hidden)
            scaled_rows = scaled.reshape(batch, new, hidden)
            got = qkv_rope_cache(scaled_rows, w_qkv, None, 1e-5, cos, sin, k_cache, v_cache, slots, squares)
            want = qkv_reference(h_rows, w_qkv, g, cos, sin, 2, 1, 32)
            for name, a, b in zip("qkv", (got, k_cache, v_cache), want):
                assert relative_error(a, b) < tolerance(dtype), (
                    "scaled qkv",
                    name,
                    x_shape,
                    relative_error(a, b),
                )
            maps += 1
    if shape is None:
        args = (x, w, r, g)
        torch.library.opcheck(
            skinny.skinny_linear_norm_out, args, test_utils=("test_schema", "test_faketensor")
        )
        for bad in ((x, w, r, g[1:]), (x[:1, :1], w, r[:1, :1], g)):  # g not h's; one row
            try:
                skinny.skinny_linear_norm_out(*bad)
            except ValueError:
                continue
            raise AssertionError("skinny_linear_norm_out took bad arguments")
    return maps


def check_qkv_rope_cache(device: str, dtype: torch.dtype) -> None:
    """q|k|v of the rows (and of one normed row), q and k rotated, k and v written at each row's
    slots (consecutive, and scattered as a token tree's are), against the same steps in PyTorch in
    fp64: q, the entries written, and the caches' other entries exactly as they were."""
    torch.manual_seed(0)
    cases = [  # batch, new tokens, query heads, K/V heads, head size, features, cache capacity
        (1, 1, 4, 2, 16, 64, 40),
        (1, 1, 32, 8, 128, 96, 20),
        (3, 4, 8, 2, 32, 96, 50),
        (2, 8, 4, 4, 64, 48, 30),
        (8, 8, 4, 1, 16, 40, 20),
    ]
    for batch, new, heads, kv_heads, dim, features, capacity in cases:
        x = torch.randn(batch, new, features, device=device, dtype=dtype)
        w = torch.randn((heads + 2 * kv_heads) * dim, features, device=device, dtype=dtype) / features**0.5
        g = 1 + 0.5 * torch.randn(features, device=device, dtype=dtype)
        cos, sin = rotary_tables(batch, new, dim, device, dtype)
        slots = torch.stack([torch.randperm(capacity, device=device)[:new] for _ in range(batch)])
        if batch == 3:  # consecutive, as a decode or verify step places them
            slots = (
                torch.arange(new, device=device) + torch.tensor([[0], [9], [40]], device=device)
            ).contiguous()
        k_cache, v_cache = (
            torch.randn(batch, capacity, kv_heads, dim, device=device, dtype=dtype) for _ in "kv"
        )
        rows = torch.arange(batch, device=device)[:, None]
        untouched = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        untouched[rows, slots] = False
        before = k_cache.clone(), v_cache.clone()
        for norm in (None, g) if batch * new == 1 else (None,):  # the norm: one row only
            case = (norm is None, batch, new, heads, kv_heads, dim)
            want = qkv_reference(x, w, norm, cos, sin, heads, kv_heads, dim)
            got = qkv_rope_cache(x, w, norm, 1e-5, cos, sin, k_cache, v_cache, slots)
            for name, a, b in zip("qkv", (got, k_cache[rows, slots], v_cache[rows, slots]), want):
                assert relative_error(a, b) < tolerance(dtype), (name, *case, relative_error(a, b))
            for cache, kept in zip((k_cache, v_cache), before):
                assert torch.equal(cache[untouched], kept[untouched]), ("other entries", *case)
    k_cache, v_cache = (torch.zeros(2, 10, 1, 16, device=device, dtype=dtype) for _ in "kv")
    args = (
        torch.randn(2, 3, 24, device=device, dtype=dtype),
        torch.randn(64, 24, device=device, dtype=dtype),
    )
    cos = torch.randn(2, 3, 16, device=device, dtype=dtype)
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]], device=device)
    torch.library.opcheck(
        qkv_rope_cache,
        (*args, None, 0.0, cos, cos, k_cache, v_cache, slots),
        test_utils=("test_schema", "test_faketensor"),
    )


def rotary_tables(batch: int, new: int, dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, S, d] of random angles, repeated over the two halves as `Rotary`'s are."""
    angles = torch.rand(batch, new, dim // 2, device=device) * 6.28
    return tuple(torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))


def qkv_reference(x, w, norm, cos, sin, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """q, k (rotated) and v of `qkv_rope_cache`'s inputs, in fp64 through the model's own functions."""
    qkv = F.linear(x.double() if norm is None else rms_norm(x.double(), norm.double(), 1e-5), w.double())
    q, k, v = (
        t.unflatten(-1, (-1, dim)) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    return apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double()), v


def check_block_shapes(device: str, dtype: torch.dtype) -> None:
    """Every block shape the GPU's tuning may choose, forced one at a time (the tuning keeps only the
    fastest, and the interpreter runs one): `skinny_linear` plain, normed with a residual and gated
    at one row, and plain with a tile of rows; `qkv_rope_cache` at one normed row and with a tile
    of rows. Each row-tile shape is forced at one of the tiles that offer it (16, 32 or 64 rows in
    turn); on a
    GPU, where a row tile compiles a dot of its own (ROWS is a constant), the swapped ones at all
    three (the interpreter compiles nothing: the rows change only the masks there). On a GPU a
    shape past its shared memory or registers is left out, as the tuning leaves it out
    (`skinny_linear._timed`); every other one must run."""

    forced = [(1, shape) for shape in skinny._candidates(1, gpu=True)]
    for i, shape in enumerate(skinny._candidates(skinny.MAX_ROWS, gpu=True)):
        tiles = [tile for tile in (16, 32, 64) if shape in skinny._candidates(tile, gpu=True)]
        every_tile = shape["SWAP"] and device == "cuda"
        forced += [(tile, shape) for tile in (tiles if every_tile else [tiles[i % len(tiles)]])]
    timed, too_large = skinny._block_shape, []
    try:
        for tile, shape in forced:
            try:
                check_block_shape(skinny, tile, shape, device, dtype)
            except resource_errors(device):
                too_large.append((tile, shape))
    finally:
        skinny._block_shape = timed
    assert len(too_large) < len(forced) / 4, ("most block shapes do not fit this GPU", too_large)


def resource_errors(device: str) -> tuple[type[Exception], ...]:
    """What a block shape too large for the GPU raises (none under the interpreter)."""
    if device != "cuda":
        return ()
    from triton.runtime.errors import OutOfResources, PTXASError

    return OutOfResources, PTXASError


def check_block_shape(skinny, tile: int, shape: dict, device: str, dtype: torch.dtype) -> None:
    """One forced block shape at one row tile (`check_block_shapes`)."""
    torch.manual_seed(0)
    features = 72
    # one row: a program per 1–16 outputs, each a Python loop under the interpreter, so fewer outputs
    # (41: a last block short of full at every BLOCK_N) and heads of 16; row tiles: blocks up to 256
    outputs, dim = (41, 16) if tile == 1 else (200, 128)
    w = torch.randn(outputs, features, device=device, dtype=dtype) / features**0.5
    g = 1 + 0.5 * torch.randn(features, device=device, dtype=dtype)
    w_qkv = torch.randn(4 * dim, features, device=device, dtype=dtype) / features**0.5  # 2 + 2 · 1 heads
    launched = []  # the kernels asked for a block shape: none fell back to PyTorch
    skinny._block_shape = lambda key, launch, candidates: launched.append(key) or shape
    rows = 1 if tile == 1 else tile // 2 + 1  # a tile of its own size
    x = torch.randn(rows, features, device=device, dtype=dtype)
    r = torch.randn(rows, outputs, device=device, dtype=dtype)
    cases = [((x, w), F.linear(x.double(), w.double()))]
    if tile == 1:
        normed = F.linear(rms_norm(x.double(), g.double(), 1e-5), w.double())
        cases.append(((x, w, False, r, g, 1e-5), normed + r))
        gate_up = torch.randn(1, 2 * features, device=device, dtype=dtype)
        gate, up = gate_up.double().chunk(2, -1)
        cases.append(((gate_up, w, True), F.linear((F.silu(gate) * up).to(dtype).double(), w.double())))
    for args, want in cases:
        err = relative_error(skinny_linear(*args), want)
        assert err < tolerance(dtype), ("skinny", tile, shape, len(args), err)
    if tile > 1:  # silu_gate_up: [gate | up] of 256 features each, whole blocks at every BLOCK_N
        w_gate_up = torch.randn(512, features, device=device, dtype=dtype) / features**0.5
        gate, up = F.linear(x.double(), w_gate_up.double()).to(dtype).double().chunk(2, -1)
        err = relative_error(skinny.silu_gate_up(x, w_gate_up), F.silu(gate) * up)
        assert err < tolerance(dtype), ("silu_gate_up", tile, shape, err)
        cases.append("silu_gate_up")
        # the norm split between maps: silu_gate_up's 2I = 256, whole blocks at every BLOCK_N
        cases += ["split norm"] * check_split_norm(device, dtype, shape)
    rope = skinny.holds_rotary_pairs(shape, dim)
    if rope:
        batch, new = (1, 1) if tile == 1 else (rows // 4 + 1, 4)
        check_qkv_shape(w_qkv, g if tile == 1 else None, batch, new, dim, device, dtype, shape)
    assert len(launched) == len(cases) + rope, ("launches", tile, shape, launched)


def check_qkv_shape(w, norm, batch: int, new: int, dim: int, device, dtype, shape: dict) -> None:
    x = torch.randn(batch, new, w.shape[1], device=device, dtype=dtype)
    cos, sin = rotary_tables(batch, new, dim, device, dtype)
    k_cache, v_cache = (torch.zeros(batch, new + 3, 1, dim, device=device, dtype=dtype) for _ in "kv")
    slots = (torch.arange(new, device=device) + 2).expand(batch, new)
    got = qkv_rope_cache(x, w, norm, 1e-5, cos, sin, k_cache, v_cache, slots)
    for name, a, b in zip(
        "qkv", (got, k_cache[:, 2:-1], v_cache[:, 2:-1]), qkv_reference(x, w, norm, cos, sin, 2, 1, dim)
    ):
        assert relative_error(a, b) < tolerance(dtype), ("qkv_rope_cache", name, shape, batch, new)
    assert not k_cache[:, :2].any() and not v_cache[:, -1].any(), ("other entries", shape)


@torch.inference_mode()
def check_model_steps(device: str, dtype: torch.dtype, compiled: bool = False) -> None:
    """A Llama target's decode and verify steps through both kernels, with the layer's work folded
    into the maps and without, equal SDPA's and cuBLAS's on the same cache: rows of three lengths,
    and one row (whose decode takes the gated down_proj), 1 and 3 new tokens, the states and the
    cache writes. A Qwen3 target too, eagerly (its q/k norms keep the rotary and cache writes out
    of the q|k|v map)."""
    models = [random_llama(tiny_llama(), device, dtype, seed=0)]
    if not compiled:  # the same kernel calls, compiled: the Llama target's cover Inductor's side
        models.append(
            random_qwen3(Qwen3Config(**{**vars(tiny_llama()), "head_dim": 32}), device, dtype, seed=0)
        )
    for model in models:
        if compiled:
            model.compile_layers()
            # five kernel configurations in one process, each its own graphs (with the norms split,
            # a layer takes a tensor or NormedRows and a next norm or None): past compile_layers' 32
            allow_compiled_variants(64)
        for lengths in ([40, 25, 33], [30]):
            check_steps(model, torch.tensor(lengths, device=device), dtype)


def check_steps(model, lengths: torch.Tensor, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    rows, device, vocab = len(lengths), lengths.device, model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (rows, 40), device=device)
    steps = [torch.randint(0, vocab, (rows, n), device=device) for n in (1, 3, 1)]
    results = {}
    configurations = [("sdpa", "cublas", True, False), ("split", "skinny", True, False)]
    configurations += [("split", "skinny", True, True), ("split", "skinny", False, False)]
    # the norms split with SiLU·up in the epilogue (silu_gate_up and qkv_rope_cache take the squares;
    # skinny_linear's are checked at the op, check_split_norm)
    configurations += [("split", "skinny", True, True, True)]
    try:
        for kernels in configurations:  # then: a tile's SiLU·up in gate_up's epilogue, its norm split
            use_cached_kernel(kernels[0])
            use_linear_kernel(*kernels[1:])
            cache = model.new_cache(rows, 64)
            model.forward_cached(prompt, cache)  # a prefill: SDPA and cuBLAS under both
            cache.lengths += lengths  # rows of their own lengths
            states = []
            for ids in steps:
                states.append(model.forward_cached(ids, cache, static=True))
                cache.lengths += ids.shape[1]
            results[kernels] = (states, cache)
    finally:  # the defaults back, for whatever runs next in this process (the GPU tests)
        use_cached_kernel("auto")
        use_linear_kernel("auto")
    (want, want_cache), *others = results.values()
    for (got, got_cache), kernels in zip(others, list(results)[1:]):
        for g, w in zip(got, want):
            assert relative_error(g, w) < 10 * tolerance(dtype), (kernels, rows, relative_error(g, w))
        assert relative_error(got_cache.k, want_cache.k) < 10 * tolerance(dtype), kernels
        assert relative_error(got_cache.v, want_cache.v) < 10 * tolerance(dtype), kernels


def check_graphed_steps(device: str, dtype: torch.dtype) -> None:
    """Decode and 3-token verify steps through both kernels replayed from CUDA graphs captured with
    PDL and without equal the same steps run eagerly without it, three in a row, for three rows
    and for one. With it one row's kernels launch with programmatic dependent launch on Hopper
    (`triton_support`): each waits for the kernel before inside, which a graph keeps as an edge
    of its own; one that read its input before the wait would read the last replay's."""
    from inference_ref.decode_graph import DecodeStep
    from inference_ref.triton_support import launch_options, use_pdl, uses_pdl

    model = random_llama(tiny_llama(), device, dtype, seed=0)
    torch.manual_seed(2)
    use_cached_kernel("split")
    use_linear_kernel("skinny")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    default_pdl = uses_pdl()
    try:
        launches = ((False, False), (True, False), (True, True))  # PDL off, for one row, for tiles too
        for (pdl, tiles), lengths, new in itertools.product(launches, ([40, 25, 33], [30]), (1, 3)):
            use_pdl(False)
            rows = len(lengths)
            cache = model.new_cache(rows, 64)
            model.forward_cached(torch.randint(0, model.cfg.vocab_size, (rows, 40), device=device), cache)
            cache.lengths += torch.tensor(lengths, device=device)
            eager = DecodeStep(model, cache, new, graph=False)
            use_pdl(pdl, tiles)  # the graph keeps the launches it captures
            graphed = DecodeStep(model, cache, new, graph=True)
            assert launch_options(cache.lengths.device, rows * new)["PDL"] == (
                pdl and hopper and (rows * new == 1 or tiles)
            )
            use_pdl(False)
            for _ in range(3):
                ids = torch.randint(0, model.cfg.vocab_size, (rows, new), device=device)
                want = eager(ids).clone()
                got = graphed(ids)  # the same cache entries written again
                error = relative_error(got, want)
                assert error < 10 * tolerance(dtype), (pdl, tiles, rows, new, error)
                cache.lengths += new
    finally:
        use_cached_kernel("auto")
        use_linear_kernel("auto")
        use_pdl(*default_pdl)


@torch.inference_mode()
def check_draft_in_graphs(device: str, dtype: torch.dtype) -> None:
    """With `use_linear_kernel`'s in_graphs, a draft's chained step and logits run their maps (the
    layer's and lm_head) through the skinny kernels inside `recording_graph` (a graphed step's
    warm-up and capture) and equal cuBLAS's outside it; without in_graphs, inside it too, they run
    none."""
    from benchmarks.random_draft import head_spec, random_draft
    from inference_ref.skinny_linear import recording_graph

    target = random_llama(tiny_llama(), device, dtype, seed=0)
    draft = random_draft(target, head_spec("rmsnorm-restored", target.cfg))
    torch.manual_seed(3)
    rows, h = 3, target.cfg.hidden_size
    y = torch.randn(rows, h, device=device, dtype=dtype)
    token = torch.randint(0, target.cfg.vocab_size, (rows,), device=device)

    def step(in_graphs: bool, recording: bool) -> tuple[torch.Tensor, list[int]]:
        """The logits, and the output features of each map `_skinny` computed."""
        use_linear_kernel("auto", in_graphs=in_graphs)
        cache = draft.new_cache(rows, 16)
        cache.lengths += 5
        maps, counted = [], skinny._skinny

        def counting(x, weight, *args, **kwargs):
            maps.append(weight.shape[0])
            return counted(x, weight, *args, **kwargs)

        skinny._skinny = counting
        try:
            with recording_graph() if recording else contextlib.nullcontext():
                return draft.logits(draft.chain(y, token, cache, 1, static=True)), maps
        finally:
            skinny._skinny = counted
            use_linear_kernel("auto")

    want, plain = step(in_graphs=True, recording=False)
    got, skinny_maps = step(in_graphs=True, recording=True)
    off, off_maps = step(in_graphs=False, recording=True)
    assert plain == [] and off_maps == [], (plain, off_maps)
    # o_proj and down_proj (q|k|v and gate_up have kernels of their own), and the lm_head
    assert sorted(skinny_maps) == sorted([h, h, draft.lm_head.out_features]), skinny_maps
    assert relative_error(got, want) < 10 * tolerance(dtype), relative_error(got, want)
    assert torch.equal(off, want)


POINTER_TYPES = {
    "SQ": "*fp32",
    "Slots": "*i64",
    "Lengths": "*i64",
    "Part": "*fp32",
    "Lse": "*fp32",
}  # others: bf16
FLOAT_SCALARS = ("eps", "scale_log2")  # others: int32


def compile_for_hopper(kernel: str) -> list[str]:
    """Compile a Triton kernel's variants for sm90 (an H100 or H200) on this machine, with the
    ptxas Triton ships: what only a GPU's compiler rejects (layouts, `qkv_rope_cache`'s reshapes
    and joins of rotary pairs) shows without one. Representative block shapes (the narrowest and a
    wide one-row one, 16- and 64-row tiles, plain and swapped); the other candidates differ in
    numbers only, and one past a GPU's shared memory is dropped when the shapes are timed. A line
    per variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import inference_ref.split_kv_attention as split

    def compiled(fn, pointers: str, scalars: str, constants: dict, warps: int = 4, stages: int = 3) -> str:
        signature = {name: POINTER_TYPES.get(name, "*bf16") for name in pointers.split()}
        signature |= {name: "fp32" if name in FLOAT_SCALARS else "i32" for name in scalars.split()}
        source = ASTSource(fn, signature | dict.fromkeys(constants, "constexpr"), constants)
        options = {"num_warps": warps, "num_stages": stages}
        binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        return f"{fn.__name__} {constants} {options}: {binary.metadata.shared} B shared"

    shapes = [
        (1, 2, 2048, 4, 1, False), (1, 16, 512, 8, 4, False), (16, 16, 256, 4, 4, False),
        (64, 128, 64, 4, 4, False), (16, 64, 128, 4, 4, True), (64, 128, 128, 8, 3, True),
    ]  # fmt: skip
    tile = {"PRECISION": "tf32"}
    done = []

    if kernel == "skinny":
        pointers, scalars = "X W Y R G YG SQ", "M N K stride_xm stride_wn stride_ym stride_rm eps"
        for rows, n, k, warps, stages, swap in shapes:
            variants = [(False, False, rows == 1, False, False), (rows == 1, True, False, False, False)]
            if rows > 1:  # a norm split between maps: the first's epilogue, the second's
                variants += [(False, True, False, False, True), (False, False, False, True, False)]
            for gated, residual, norm, scaled, norm_out in variants:
                for pdl in (False, True):  # as `triton_support.launch_options` may launch them
                    flags = dict(GATED=gated, RESIDUAL=residual, NORM=norm, SWAP=swap, PDL=pdl)
                    flags |= dict(SCALED=scaled, NORM_OUT=norm_out)
                    constants = dict(ROWS=rows, BLOCK_N=n, BLOCK_K=k, **tile, **flags)
                    done.append(compiled(skinny._skinny_gemm, pointers, scalars, constants, warps, stages))
            for pdl, scaled in itertools.product((False, True), (False, True)) if rows > 1 else ():
                constants = dict(ROWS=rows, BLOCK_N=n, BLOCK_K=k, **tile, SWAP=swap, PDL=pdl, SCALED=scaled)
                pointers_scalars = ("X W Y SQ", "M N K stride_xm stride_wn stride_ym eps")
                done.append(compiled(skinny._silu_gate_up, *pointers_scalars, constants, warps, stages))
    elif kernel == "qkv_rope_cache":
        pointers = "X W G Q KC VC Cos Sin Slots SQ"
        scalars = (
            "M K new eps stride_xm stride_wn stride_qm stride_qh stride_cm stride_sb stride_ss "
            "stride_kb stride_kl stride_kh stride_vb stride_vl stride_vh"
        )
        heads = dict(HEADS=32, KV_HEADS=8, DIM=128)
        for rows, n, k, warps, stages, swap in shapes:
            for norm, pdl, scaled in itertools.product({rows == 1, False}, (False, True), {rows > 1, False}):
                flags = dict(NORM=norm, SWAP=swap, PDL=pdl, SCALED=scaled)
                constants = dict(**heads, ROWS=rows, BLOCK_N=n, BLOCK_K=k, **tile, **flags)
                done.append(compiled(skinny._qkv_rope_cache, pointers, scalars, constants, warps, stages))
    else:
        heads = dict(KV_HEADS=8, GROUP=4, SPLITS=16, DIM=128)
        scalars = "stride_lb stride_qb stride_qs stride_qh stride_kb stride_kl stride_kh stride_vb stride_vl stride_vh"
        partial, merge = split._split_kv_attention_partial, split._split_kv_attention_merge
        for rows, pdl in ((16, False), (16, True), (64, False)):  # 16: one token's group of 4 heads
            constants = dict(**heads, ROWS=rows, KEYS=split.BLOCK_KEYS, **tile, PDL=pdl)
            done.append(compiled(partial, "Q K V Lengths Out Lse", scalars + " new scale_log2", constants))
        for pdl in (False, True):
            constants = dict(**heads, SPLITS_POW2=16, ROWS=16, PDL=pdl)
            done.append(compiled(merge, "Part Lse Out", "stride_ob stride_os stride_oh", constants))
    return done


CHECKS = {
    "split_kv": check_split_kv,
    "skinny": check_skinny,
    "qkv_rope_cache": check_qkv_rope_cache,
    "block_shapes": check_block_shapes,
    "model_steps": check_model_steps,
    "draft_in_graphs": check_draft_in_graphs,
}


def run_check(spec: str) -> None:
    """One check by its spec, "name device dtype [compiled]" (`CHECKS`)."""
    name, device, dtype, *flags = spec.split()
    CHECKS[name](device, getattr(torch, dtype), *(a == "compiled" for a in flags))


def run_each(specs: list[str]) -> bool:
    """Each check in turn, in this process (what the checks import is paid once): a line per spec,
    "OK spec", or "FAILED spec" and its traceback up to a line "END spec". Whether all passed."""
    import traceback

    passed = True
    for spec in specs:
        try:
            run_check(spec)
            print("OK", spec, flush=True)
        except Exception:
            passed = False
            print(f"FAILED {spec}\n{traceback.format_exc()}END {spec}", flush=True)
    return passed


if __name__ == "__main__":
    if sys.argv[1] == "--each":  # python tests/kernel_checks.py --each "skinny cpu float32" ...
        sys.exit(0 if run_each(sys.argv[2:]) else 1)
    run_check(" ".join(sys.argv[1:]))
    print("OK", " ".join(sys.argv[1:]))
