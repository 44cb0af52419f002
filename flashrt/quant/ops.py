"""Reference quantization ops in pure torch: they run on CPU (and any device) so quality can be measured.

Shapes: x (..., in) GEMM input; w (out, in) weight; per-channel scales are (out,) along `axis` (0).

Scheme (symmetric, zero point 0):
    scale = amax / qmax            qmax = 448 (fp8_e4m3) or 127 (int8); amax == 0 gives scale 1
    q     = saturate(x / scale)    fp8: clamp to ±448 then round-to-nearest-even cast to float8_e4m3fn
                                   int8: round half to even, clamp to [-127, 127]
    x'    = q * scale              (in float32)
Errors this guarantees for |x| <= amax (pinned by tests):
    int8: |x - x'| <= scale / 2
    fp8:  |x - x'| <= max(|x| * 2**-4, scale * 2**-10)   (3 mantissa bits; subnormal step 2**-9)
Scales are float32; combine them in float32 too (alpha = act_scale * w_scale): a float64 product rounded
later is not what the GPU GEMM epilogue computes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flashrt.errors import CalibrationError
from flashrt.quant.precision import DTypeInfo, PrecisionSpec, TensorSpec, dtype_info


def _info(dtype: str | DTypeInfo) -> DTypeInfo:
    return dtype if isinstance(dtype, DTypeInfo) else dtype_info(dtype)


def amax_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (on x's device, no host sync)."""
    return x.detach().abs().amax().float()


def amax_per_channel(x: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """max |x| over every dim but `axis`: (x.shape[axis],) float32 (weights: one per output channel)."""
    moved = x.detach().movedim(axis, 0)
    return moved.abs().reshape(moved.shape[0], -1).amax(dim=1).float()


def amax(x: torch.Tensor, granularity: str = "per_tensor", axis: int = 0) -> torch.Tensor:
    """Per-tensor or per-channel amax (granularity as in TensorSpec)."""
    if granularity == "per_tensor":
        return amax_per_tensor(x)
    if granularity == "per_channel":
        return amax_per_channel(x, axis)
    raise ValueError(f"unknown granularity {granularity!r}; use 'per_tensor' or 'per_channel'")


def compute_scale(amax_value: torch.Tensor | float, dtype: str | DTypeInfo) -> torch.Tensor:
    """amax / qmax in float32; zero amax maps to scale 1; non-finite or negative amax is refused."""
    info = _info(dtype)
    if not info.quantized:
        raise ValueError(f"{info.name} is not a quantized dtype; it has no scale")
    a = torch.as_tensor(amax_value, dtype=torch.float32)
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise CalibrationError(f"amax must be finite and >= 0 to compute a {info.name} scale, got {a}")
    return torch.where(a > 0, a / info.qmax, torch.ones_like(a))


def _broadcast(scale: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if scale.numel() == 1:
        return scale.reshape(())
    if x.dim() == 0 or scale.numel() != x.shape[axis]:
        raise ValueError(f"per-channel scale of {scale.numel()} values does not match axis {axis} "
                         f"of a tensor shaped {tuple(x.shape)}")
    shape = [1] * x.dim()
    shape[axis] = -1
    return scale.reshape(shape)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: str | DTypeInfo,
             axis: int = 0) -> torch.Tensor:
    """Saturating symmetric quantization to fp8_e4m3 (float8_e4m3fn) or int8 (per-channel along axis)."""
    info = _info(dtype)
    y = x.float() / _broadcast(scale, x, axis)
    if info.name == "fp8_e4m3":
        return y.clamp(-info.qmax, info.qmax).to(info.torch_dtype)
    if info.name == "int8":
        return torch.round(y).clamp(-info.qmax, info.qmax).to(torch.int8)
    raise ValueError(f"{info.name} is not a quantized dtype")


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, axis: int = 0,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32 (then cast to out_dtype)."""
    return (q.float() * _broadcast(scale, q, axis)).to(out_dtype)


def fake_quant(x: torch.Tensor, scale: torch.Tensor | float, dtype: str | DTypeInfo,
               axis: int = 0) -> torch.Tensor:
    """dequantize(quantize(x)) in float32: the values a quantized kernel actually sees."""
    return dequantize(quantize(x, scale, dtype, axis), scale, axis)


def quantize_weight(w: torch.Tensor, spec: TensorSpec,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a (out, in) weight; the scale is computed from w unless given (calibrated)."""
    if not spec.quantized:
        raise ValueError(f"weights spec {spec.describe()} is not quantized")
    if scale is None:
        scale = compute_scale(amax(w, spec.granularity, axis=0), spec.info)
    return quantize(w, scale, spec.info, axis=0), scale


def _fake_tensor(t: torch.Tensor, spec: TensorSpec, scale: torch.Tensor | None, role: str) -> torch.Tensor:
    """t as the kernel sees it, in float32: rounded to a float dtype, or quantized and dequantized."""
    if not spec.quantized:
        return t.to(spec.info.torch_dtype).float()
    if scale is None and spec.scale == "calibrated":
        raise CalibrationError(f"{role} is {spec.describe()} but no calibrated {role} scale was given")
    if scale is None:
        scale = compute_scale(amax(t, spec.granularity, axis=0), spec.info)
    return fake_quant(t, scale, spec.info, axis=0)


def fake_quant_linear(x: torch.Tensor, w: torch.Tensor, spec: PrecisionSpec,
                      scales: Mapping[str, torch.Tensor] | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of y = x @ w.T + bias as the GEMM described by `spec` computes it.

    x (..., in), w (out, in), bias (out,) -> y (..., out) in spec.compute's dtype. `scales` may hold
    "input" (per-tensor) and "weight" (per-tensor or (out,)) scales; calibrated sources require them,
    dynamic sources compute them from the tensor. Products accumulate in float32 (as fp8/int8/bf16
    tensor-core GEMMs do); the bias is added in float32 before the output is rounded.
    """
    scales = scales or {}
    xs = _fake_tensor(x, spec.activations, scales.get("input"), "input")
    ws = _fake_tensor(w, spec.weights, scales.get("weight"), "weight")
    if spec.weights.quantized and not spec.activations.quantized:
        ws = ws.to(spec.activations.info.torch_dtype).float()  # weight-only: dequantized to the input dtype
    y = xs @ ws.T
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype_info(spec.compute).torch_dtype)
