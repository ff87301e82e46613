"""FP8 (e4m3) targets, applied to a built model by one function (`quantize`), never inside model code.

Weights are quantized at load with one scale per output channel; activations are scaled
dynamically, one scale per token; the matmul runs on FP8 tensor cores through `torch._scaled_mm`
with those row-wise scales (Hopper), accumulating in fp32 and writing the activations' dtype.
Where that kernel does not run (a CPU, an older GPU), `Fp8Linear` computes the same quantized
product in fp32 from the dequantized operands, so the numbers a CPU test sees are the ones the
tensor cores see up to accumulation order.

`quantize(model, static_inputs=True)` scales each linear map's input by one fixed scale instead
(vLLM's static FP8 scheme): the largest absmax / 448 over the forwards run inside
`with calibration(model):` (eager, before any step is captured), fixed from then on. The e4m3 cast
then fuses into the op that produces the input in one pass, with no amax to read first. Inputs past
the calibrated range saturate at ±448 × scale; a map that was never calibrated refuses to run.

Only the decoder layers' linear maps are quantized (attention and dense-MLP projections): the
embeddings, the final norm, the lm_head, the MoE routers and MLA's kv_b_proj (`KEPT`) stay in the
model's dtype, as serving stacks keep them. Checkpoints stored in FP8 with 128×128 block scales (DeepSeek-V3's
`weight_scale_inv`) are read through `dequantize_blocks`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] → (e4m3 [N, K], fp32 scale [N, 1]): each row scaled so its absmax maps to 448."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    # Clamp: rounding can put x / scale a hair past 448, which e4m3fn would turn into NaN.
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """A weight stored in FP8 with one scale per `block` × `block` tile (DeepSeek-V3's
    `weight_scale_inv` [ceil(out/128), ceil(in/128)]) → fp32: w = q × scale of its tile."""
    out, k = q.shape
    scale = scale_inv.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :k]
    return q.float() * scale


class Fp8Linear(nn.Module):
    """`nn.Linear` (no bias) with an e4m3 weight and per-output-channel scales."""

    fast_accum: bool = True
    """Hopper's fast FP8 accumulation (`use_fast_accum`: the tensor cores' partial sums are not
    promoted to fp32 every few blocks), what serving runs: every sm90 FP8 GEMM config of vLLM's
    CUTLASS kernels is an `…FP8FastAccum` schedule
    (csrc/quantization/cutlass_w8a8/c3x/scaled_mm_sm90_fp8_dispatch.cuh, vLLM 16bff144). 8% faster
    at the Llama-3.1-8B shape with no measurable change in agreement (`benchmarks/bench_fp8`
    measures both); False promotes every partial sum."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, static_input: bool = False):
        super().__init__()
        self.register_buffer("weight", weight_fp8)  # [out, in] e4m3
        self.register_buffer("weight_scale", weight_scale)  # [out, 1] fp32
        self.out_features, self.in_features = weight_fp8.shape
        self.static_input = static_input
        # one scale for every input token (static_input), set by `calibration`. Not in the state
        # dict: nothing saves a quantized target.
        self.register_buffer("input_scale", torch.zeros((), device=weight_fp8.device), persistent=False)
        self.calibrating, self.calibrated_tokens = False, 0

    @classmethod
    def of(cls, linear: nn.Linear, static_input: bool = False) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear: a linear map with a bias is not quantized here")
        return cls(*quantize_rows(linear.weight.detach()), static_input=static_input)

    def calibrate(self, flat: torch.Tensor) -> None:
        """Widen the input scale to cover `flat` (inside `calibration`)."""
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():
            # a captured graph would widen the scale at every replay
            raise RuntimeError("Fp8Linear: a CUDA graph captured while calibrating static input scales")
        if flat.numel() == 0:
            return
        amax = flat.detach().float().abs().amax().clamp_min(1e-12)
        self.input_scale.copy_(torch.maximum(self.input_scale, amax / FP8_MAX))
        self.calibrated_tokens += flat.shape[0]

    def quantize_input(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 [T, in], fp32 scale [T, 1]): per token, or the one static scale for every token."""
        if not self.static_input:
            return quantize_rows(flat)
        if self.calibrating:
            self.calibrate(flat)
        elif self.calibrated_tokens == 0:
            raise RuntimeError(
                "Fp8Linear: static input scales not calibrated: run the model on calibration text "
                "inside `with inference_ref.quantization.calibration(model):` first"
            )
        scale = self.input_scale
        xq = (flat.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return xq, scale.expand(flat.shape[0], 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        xq, xs = self.quantize_input(flat)
        if flat.is_cuda and flat.shape[0] > 0:
            # Row-wise scales: a [T, 1] per token, b [1, out] per output channel; b column-major.
            scale_b = self.weight_scale.reshape(1, -1).contiguous()
            out = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=xs,
                scale_b=scale_b,
                out_dtype=x.dtype,
                use_fast_accum=self.fast_accum,
            )
        else:
            out = (dequantize_rows(xq, xs) @ dequantize_rows(self.weight, self.weight_scale).t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


KEPT = ("router", "kv_b_proj")
"""Linear maps of a layer that stay in the model's dtype: MoE routers (they decide, they are tiny and
fp32) and MLA's kv_b_proj, whose weight the cached forward reads as a matrix to absorb into the
query and output (`deepseek_v2.mla`), as vLLM keeps it dequantized for that."""


def quantizable(layer: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The linear maps of a decoder layer that `quantize` turns into FP8 ones, by name (not `KEPT`)."""
    for name, module in list(layer.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith(KEPT):
            yield name, module


def quantize_layer(layer: nn.Module, static_inputs: bool = False) -> None:
    """Replace the layer's `quantizable` maps by `Fp8Linear`s, in place, on the layer's device."""
    for name, module in quantizable(layer):
        parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
        setattr(parent, name.rsplit(".", 1)[-1], Fp8Linear.of(module, static_inputs))


def quantize(model: nn.Module, static_inputs: bool = False) -> nn.Module:
    """Replace every linear map of the model's decoder layers by an `Fp8Linear`, in place (the
    embeddings and lm_head are not `nn.Linear`s of a layer; routers are kept). `static_inputs`: one
    calibrated scale per map's input instead of one per token (see the module's notes). Returns the
    model."""
    for layer in model.layers:
        quantize_layer(layer, static_inputs)
    return model


def quantize_onto(model: nn.Module, device, static_inputs: bool = False) -> nn.Module:
    """`quantize` a model built on the CPU while moving it onto `device`, one decoder layer at a
    time: the device holds the FP8 layers so far and one layer in the model's dtype, never the whole
    model in it, so a target that fits a GPU only in FP8 loads there. Returns the model."""
    for layer in model.layers:
        layer.to(device)
        quantize_layer(layer, static_inputs)
    return model.to(device)  # the embeddings, final norm and lm_head; no dtype: FP8 stays FP8


@contextmanager
def calibration(model: nn.Module) -> Iterator[None]:
    """`with calibration(model): <forwards>`: every static-input FP8 map of the model takes the
    largest absmax / 448 of its inputs over those forwards as its scale, fixed after the block.
    The layers run eagerly inside it (a compiled frame would keep the calibration's graph breaks,
    and a captured graph would replay it); compiled ones compile again after it."""
    maps = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.static_input]
    if not maps:
        raise ValueError(
            "calibration: the model has no FP8 maps with static input scales (quantize(model, static_inputs=True))"
        )
    for m in maps:
        m.input_scale.zero_()
        m.calibrating, m.calibrated_tokens = True, 0
    compiled = getattr(model, "compiled_layers", False)
    model.compiled_layers = False
    try:
        yield
    finally:
        model.compiled_layers = compiled
        for m in maps:
            m.calibrating = False
    if any(m.calibrated_tokens == 0 for m in maps):
        raise ValueError("calibration: the forwards inside it reached no FP8 map (no tokens?)")
