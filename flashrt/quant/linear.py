"""Quantized GEMM weights that every ``F.linear`` call site picks up: W8A8 int8 and fp8 E4M3.

A `QuantWeight` replaces an ``nn.Linear``'s ``weight`` (`install`); model code stays as written. It
looks like the float weight it replaces (shape (out, in), the compute dtype), and:

* ``F.linear(x, w, b)`` runs the quantized GEMM (`QuantWeight.linear`);
* ``w[rows]`` / ``w[:, cols]`` give a sliced `QuantWeight` (per-channel scales follow the rows), so
  code that runs a slice of a fused projection (q|k|v, gate|up) stays quantized;
* anything else (``torch.ops.mkldnn._linear_pointwise``, arithmetic, ``repr``) sees the dequantized
  float weight, is correct, and is counted in `FALLBACKS` (tests pin zero on the hot path).

Schemes (symmetric, zero point 0; ``q`` integers, ``s`` float32 scales):

    int8   w_q = round(w / s_w), s_w = amax(row) / 127, per output channel, at load
           x_q = clamp(round(x / s_x), ±qa): static s_x = amax / qa from the calibration cache
           ("static"), or one s_x per row computed per call ("per_token")
           y   = float(Σ x_q w_q) * (s_x s_w) + b        Σ exact in int32
    fp8    w8  = e4m3(w / s_w), x8 = e4m3(clamp(x / s_x, ±448)), s_w per tensor, s_x static
           y   = (Σ x8 w8) * (s_x s_w) + b               Σ in float32 (exact products)

``qa``, the activation range, is a property of the machine (`activation_qmax`): 127 where the int8 dot
product accumulates without saturating (CUDA; CPUs with VNNI/AMX), 63 on CPUs without (AVX2's
``vpmaddubsw`` adds pairs of u8 x s8 products in int16: 255 x 127 x 2 overflows it, 127 x 127 x 2 does
not). Every int8 kernel on one machine therefore computes the same integers, whichever is chosen.

Kernels (`INT8_KERNELS`, `FP8_KERNELS`), chosen per (device, M, K, N) by measurement (`tuning`,
`KernelTable`): ``onednn`` (oneDNN's u8 x s8 -> int32 GEMM, scales and bias in its epilogue),
``int_mm`` (``torch._int_mm``), ``float`` (the same integers in a float32 GEMM: exact while
K * qa * 127 < 2**24, i.e. K <= 2080 at qa = 63; the documented fallback where no int8 GEMM is faster),
``scaled_mm`` (CUDA fp8, ``torch._scaled_mm``) and ``emulate`` (fp8 quantize -> dequantize, float32
GEMM: the exact CPU emulation). Never measured, run only inside `portable()` (an ONNX export): ``qdq``
(int8 as quantize -> dequantize around a float GEMM, exported as QuantizeLinear / DequantizeLinear with
the calibrated scales, so onnxruntime and TensorRT run int8 with flashrt's scales, never their own
calibrators) and its fp8 counterpart (`fp8_qdq` / `fp8_dequant`, exported as float8e4m3fn Q/DQ).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.ops import Op, register
from flashrt.ops.platform import activation_qmax

FALLBACKS: Counter = Counter()  # op name -> calls that saw a dequantized weight (not the quantized GEMM)
FP8_MAX = 448.0
W_QMAX = 127
MODES = ("static", "per_token")


def onednn_int8_available() -> bool:
    """Whether torch ships oneDNN's int8 linear (``onednn::qlinear_pointwise``)."""
    try:
        return torch.ops.onednn.qlinear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


# ------------------------------------------------------------------------------------ per-site stats
@dataclass
class SiteStats:
    """What the quality gate reports per GEMM site (`audit` mode): output error against the float
    GEMM on the same input, the fraction of inputs clipped, the largest input seen.

    The relative error is judged per sample (`end_sample` closes one) and the worst sample's is
    reported: pooled over samples, one badly quantized quiet sample (small outputs, so small squared
    errors) would vanish among good loud ones."""

    amax: float = 0.0
    clipped: float = 0.0
    err_sq: float = 0.0  # of the current sample
    ref_sq: float = 0.0  # of the current sample
    calls: int = 0
    worst: float = 0.0  # the largest relative error of a closed sample

    def add(self, x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor, limit: float) -> None:
        self.amax = max(self.amax, float(x.abs().max()))
        self.clipped = max(self.clipped, float((x.abs() > limit).float().mean()))
        self.err_sq += float((y.double() - ref.double()).square().sum())
        self.ref_sq += float(ref.double().square().sum())
        self.calls += 1

    def end_sample(self) -> None:
        """Close the current sample: its relative error counts toward `worst`; sums restart."""
        self.worst, self.err_sq, self.ref_sq = self.rel_error, 0.0, 0.0

    @property
    def rel_error(self) -> float:
        """The worst relative output error of any sample so far (the current one included)."""
        current = (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0
        return max(self.worst, current)

    def to_dict(self) -> dict[str, float]:
        return {"rel_error": self.rel_error, "clipped": self.clipped, "amax": self.amax, "calls": self.calls}


# ----------------------------------------------------------------------------------------- the weight
class QuantWeight(torch.Tensor):
    """A quantized (out, in) GEMM weight standing in for a float one (module docstring)."""

    kind: str  # "int8" | "fp8"
    q: torch.Tensor  # (out, in) int8 or float8_e4m3fn
    w_scale: torch.Tensor  # (out,) int8 per channel, () fp8 per tensor; float32
    x_amax: torch.Tensor | None  # () static calibrated activation amax; None with per_token
    qa: float  # activation range (activation_qmax for int8, 448 for fp8)
    x_scale_value: float | None  # the static activation scale as a Python float (None with per_token)
    w_scale_value: float | None  # a per-tensor weight scale (fp8) as a Python float (None per channel)
    mode: str
    site: str
    forms: dict
    audit: SiteStats | None
    reference: torch.Tensor | None  # the float weight while auditing

    @staticmethod
    def __new__(cls, q: torch.Tensor, w_scale: torch.Tensor, x_amax: torch.Tensor | None, *, kind: str,
                qa: float, mode: str = "static", dtype: torch.dtype = torch.float32, site: str = "",
                x_scale_value: float | None = None, w_scale_value: float | None = None):
        self = torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=dtype, device=q.device)
        self.kind, self.q, self.w_scale, self.x_amax = kind, q, w_scale.float(), x_amax
        self.qa, self.mode, self.site = float(qa), mode, site
        if x_scale_value is None and x_amax is not None:  # at load (slices pass their parent's value)
            x_scale_value = float(self.x_scale())
        self.x_scale_value = x_scale_value
        if w_scale_value is None and w_scale.dim() == 0:  # at load, like x_scale_value
            w_scale_value = float(w_scale)
        self.w_scale_value = w_scale_value
        self.forms, self.audit, self.reference = {}, None, None
        return self

    def __repr__(self) -> str:  # noqa: D105
        return (f"QuantWeight({self.kind}, {tuple(self.shape)}, mode={self.mode}, site={self.site!r}, "
                f"forms={sorted(k for k in self.forms if isinstance(k, str))})")

    # -------------------------------------------------------------------- torch function protocol
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return args[1].linear(args[0], bias)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], QuantWeight):
            return args[0].sliced(args[1])
        fused = _FUSED.get(_op_name(func))
        if fused is not None and isinstance(_weight_arg(func, args), QuantWeight):
            return fused(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        FALLBACKS[getattr(func, "__name__", str(func))] += 1
        return func(*_dequantized(args), **dict(zip(kwargs, _dequantized(kwargs.values()))))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        FALLBACKS[str(func)] += 1
        return func(*_dequantized(args), **dict(zip(kwargs or {}, _dequantized((kwargs or {}).values()))))

    # ----------------------------------------------------------------------------------- values
    def dequantize(self) -> torch.Tensor:
        """The float (out, in) weight the quantized one stands for, in its reported dtype."""
        s = self.w_scale if self.w_scale.dim() == 0 else self.w_scale[:, None]
        return (self.q.float() * s).to(self.dtype)

    def x_scale(self) -> torch.Tensor:
        """The static activation scale amax / qa (float32, 1 for a zero amax)."""
        a = self.x_amax.float()
        return torch.where(a > 0, a / self.qa, torch.ones_like(a))

    def sliced(self, index) -> QuantWeight:
        """``w[index]`` for row / column slices; the scales and the audit follow the rows."""
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else (*index, slice(None))[:2]
        if not (isinstance(rows, slice) and isinstance(cols, slice)):
            raise TypeError(f"QuantWeight supports slices only, got {index!r}")
        scale = self.w_scale if self.w_scale.dim() == 0 else self.w_scale[rows]
        out = QuantWeight(self.q[rows, cols], scale, self.x_amax, kind=self.kind, qa=self.qa, mode=self.mode,
                          dtype=self.dtype, site=self.site, x_scale_value=self.x_scale_value,
                          w_scale_value=self.w_scale_value)
        out.audit = self.audit
        out.reference = None if self.reference is None else self.reference[rows, cols]
        if cols == slice(None) and rows == slice(None):
            out.forms = self.forms
        else:
            key = ("slice", _slice_key(rows), _slice_key(cols))
            out.forms = self.forms.setdefault(key, {})  # slices of the same view share prepared forms
        return out

    # ------------------------------------------------------------------------------------- GEMM
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               post: str | None = None) -> torch.Tensor:
        """``F.linear(x, w, bias)`` as the quantized GEMM: x (..., in) -> (..., out) in x's dtype;
        ``post="gelu_tanh"`` applies the tanh-GELU to the result (fused into oneDNN's epilogue)."""
        x2 = x.reshape(-1, x.shape[-1])
        kernel = TABLE.choose(self, x2)
        y = KERNELS[self.kind][kernel].run(self, x2, None if bias is None else bias.float(), post)
        if self.audit is not None:
            ref = F.linear(x2.float(), self.reference.float(), None if bias is None else bias.float())
            ref = ref if post is None else F.gelu(ref, approximate="tanh")
            limit = float(self.x_scale()) * self.qa if self.x_amax is not None else float("inf")
            self.audit.add(x2, y, ref, limit)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def _op_name(func) -> str:
    """"ns::op[.overload]" of a torch.ops callable, "" for anything else."""
    if isinstance(func, torch._ops.OpOverload):
        return func.name()
    return getattr(func, "_qualified_op_name", "") if isinstance(func, torch._ops.OpOverloadPacket) else ""


def _weight_arg(func, args: tuple):
    """The weight argument of oneDNN's fused linear ops: (X, W, ...) unary, (X, other, W, ...) binary."""
    return args[2] if _op_name(func).endswith(".binary") else args[1]


def _fused_unary(x, w, bias, attr, scalars, algorithm):
    """``mkldnn::_linear_pointwise(X, W, B, "gelu", [], "tanh")`` on a QuantWeight (Gemma / SigLIP MLPs)."""
    if attr != "gelu" or algorithm != "tanh":
        return torch.ops.mkldnn._linear_pointwise(x, w.dequantize(), bias, attr, scalars, algorithm)
    return w.linear(x, bias, post="gelu_tanh")


def _fused_binary(x, other, w, bias, attr):
    """``mkldnn::_linear_pointwise.binary(X, other, W, B, "mul"|"add")`` on a QuantWeight."""
    y = w.linear(x, bias)
    if attr == "mul":
        return y.mul_(other)
    if attr == "add":
        return y.add_(other)
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, w.dequantize(), bias, attr)


_FUSED = {"mkldnn::_linear_pointwise": _fused_unary, "mkldnn::_linear_pointwise.binary": _fused_binary}

_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.is_contiguous,
             torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.__len__}


def _window(q: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int] | None:
    """(stored tensor, r0, r1, c0, c1) of a 2-D weight that is a row / column block of a dense stored one,
    row- or column-major (derived from the view's offset and strides); None for any other layout."""
    base = q if q._base is None else q._base
    dense = base.dim() == 2 and (base.is_contiguous() or base.t().is_contiguous())
    if not dense or q.stride() != base.stride():
        return None
    offset, (s0, s1) = q.storage_offset() - base.storage_offset(), base.stride()
    r0, c0 = divmod(offset, s0) if s0 >= s1 else divmod(offset, s1)[::-1]
    return base, r0, r0 + q.shape[0], c0, c0 + q.shape[1]


def _slice_key(s: slice) -> tuple:
    return s.start, s.stop, s.step


def _dequantized(values) -> list:
    return [v.dequantize() if isinstance(v, QuantWeight) else v for v in values]


# -------------------------------------------------------------------------------------- activations
def quantize_rows(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (integer-valued float32 (M, K) in [-qa, qa], its scale: () static or (M, 1))."""
    if w.mode == "static":
        scale = _form(w, "x_scale", w.x_scale)
    else:
        a = x.detach().abs().amax(dim=1, keepdim=True).float()
        scale = torch.where(a > 0, a / w.qa, torch.ones_like(a))
    return torch.div(x.float(), scale).round_().clamp_(-w.qa, w.qa), scale


def _epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
              post: str | None = None):
    """acc (M, N), float32 or an integer GEMM's int32 -> post(acc * (s_x s_w) + bias) in float32 (scales
    combined in float32; an int32 acc is converted, scaled and biased in one pass)."""
    if x_scale.dim() == 0:  # static: s_x s_w is a property of the weight, formed once
        alpha = _form(w, "alpha", lambda: x_scale * w.w_scale)
    else:
        alpha = x_scale * w.w_scale[None, :]
    if acc.dtype != torch.float32:
        y = torch.mul(acc, alpha) if bias is None else torch.addcmul(bias, acc, alpha)
        return _post(y, post)
    y = acc.mul_(alpha)
    y = y if bias is None else y.add_(bias)
    return _post(y, post)


POSTS = {"gelu_tanh": ("gelu", "tanh")}  # post-op name -> oneDNN (attr, algorithm)


def _post(y: torch.Tensor, post: str | None) -> torch.Tensor:
    if post is None:
        return y
    if post == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"unknown post-op {post!r}; known: {sorted(POSTS)}")


# ------------------------------------------------------------------------------------- int8 kernels
@dataclass(frozen=True)
class Kernel:
    """One way to run a quantized GEMM: ``applies(w, x2d)``, ``run(w, x2d, bias, post) -> y2d float32``."""

    name: str
    run: Callable[..., torch.Tensor]  # (w, x2d, bias, post=None) -> y2d float32
    applies: Callable[[QuantWeight, torch.Tensor], bool]
    doc: str = ""


def _form(w: QuantWeight, name: str, make: Callable[[], object]):
    if name not in w.forms:
        w.forms[name] = make()
    return w.forms[name]


def _int8_float(w: QuantWeight, x: torch.Tensor, bias, post=None):
    xq, scale = quantize_rows(x, w)
    wf = _form(w, "float", lambda: w.q.float().t().contiguous())  # (K, N) integer values
    return _epilogue(xq @ wf, scale, w, bias, post)


def _int8_int_mm(w: QuantWeight, x: torch.Tensor, bias, post=None):
    xq, scale = quantize_rows(x, w)
    wt = _form(w, "int_mm", lambda: w.q.t().contiguous())  # (K, N) int8
    return _epilogue(torch._int_mm(xq.to(torch.int8), wt), scale, w, bias, post)


def _onednn_zero_point(w: QuantWeight) -> int:
    return int(w.qa) + 1  # u8 = x_q + zp lies in [1, 2 qa + 1]


def _int8_onednn(w: QuantWeight, x: torch.Tensor, bias, post=None):
    xq, scale = quantize_rows(x, w)
    packed = _form(w, "onednn", lambda: torch.ops.onednn.qlinear_prepack(w.q.contiguous(), None))
    zp = _onednn_zero_point(w)
    u8 = xq.add_(zp).to(torch.uint8)
    n = w.q.shape[0]
    zeros = _form(w, "onednn_zeros", lambda: torch.zeros(n, dtype=torch.long, device=w.q.device))
    if w.mode == "static":
        w_scales = _form(w, "onednn_scales", lambda: w.w_scale.expand(n).contiguous())
        x_scale = _form(w, "x_scale_float", lambda: float(scale))  # once, at the first call
        attr, algorithm = POSTS[post] if post is not None else ("none", "")
        return torch.ops.onednn.qlinear_pointwise(u8, x_scale, zp, packed, w_scales, zeros, bias, 1.0,
                                                  0, torch.float32, attr, [], algorithm)
    ones = _form(w, "onednn_ones", lambda: torch.ones(n, device=w.q.device))
    acc = torch.ops.onednn.qlinear_pointwise(u8, 1.0, zp, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                             "none", [], "")
    return _epilogue(acc, scale, w, bias, post)


def _on_cpu(w: QuantWeight, x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def _int_mm_ok(w: QuantWeight, x: torch.Tensor) -> bool:
    m, k = x.shape
    return m > 16 and k % 8 == 0 and w.q.shape[0] % 8 == 0


def _anywhere(w: QuantWeight, x: torch.Tensor) -> bool:
    return True  # the fallback that always applies (exact while K * qa * 127 < 2**24)


def _never(w: QuantWeight, x: torch.Tensor) -> bool:
    return False  # a portable form: run only inside `portable()`, never chosen by measurement


def _int8_qdq(w: QuantWeight, x: torch.Tensor, bias, post=None):
    """The portable form of a static int8 GEMM (what an ONNX export records; `portable`): clip to the
    calibrated range, quantize -> dequantize x per tensor, dequantize w per output channel, a float GEMM.
    Exported as Clip, QuantizeLinear / DequantizeLinear and Gemm, so onnxruntime and TensorRT run the int8
    GEMM with flashrt's own scales. The integers equal `quantize_rows`' ones; the sum is formed in float
    (equal to the int32 sum times the scales within float32 rounding). Per-token activations have no
    static Q/DQ form: they export the "float" kernel (the same integers, plain float ops)."""
    if w.mode != "static":
        return _int8_float(w, x, bias, post)
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
    qd = torch.ops.quantized_decomposed
    s, qa = w.x_scale_value, w.qa
    xq = qd.quantize_per_tensor(x.float().clamp(-qa * s, qa * s), s, 0, -128, 127, torch.int8)
    xd = qd.dequantize_per_tensor(xq, s, 0, -128, 127, torch.int8)
    zeros = _form(w, "qdq_zeros", lambda: torch.zeros(w.q.shape[0], dtype=torch.int32, device=w.q.device))
    wd = qd.dequantize_per_channel(w.q, w.w_scale, zeros, 0, -W_QMAX, W_QMAX, torch.int8)
    return _post(F.linear(xd, wd, bias), post)


INT8_KERNELS: dict[str, Kernel] = {  # measured in this order: the cheap baseline first
    "float": Kernel("float", _int8_float, _anywhere,
                    "the same integers in a float32 GEMM (exact while K * qa * 127 < 2**24)"),
    "onednn": Kernel("onednn", _int8_onednn, lambda w, x: _on_cpu(w, x) and onednn_int8_available(),
                     "oneDNN u8 x s8 GEMM, int32 accumulation, scales + bias in the epilogue"),
    "int_mm": Kernel("int_mm", _int8_int_mm, _int_mm_ok, "torch._int_mm, int32 accumulation"),
    "qdq": Kernel("qdq", _int8_qdq, _never, "portable: Q/DQ around a float GEMM (ONNX export; `portable`)"),
}


# -------------------------------------------------------------------------------------- fp8 kernels
def _fp8_quantize(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return (x.float() / _form(w, "x_scale", w.x_scale)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_emulate(w: QuantWeight, x: torch.Tensor, bias, post=None):
    x8 = _fp8_quantize(x, w).float()
    wf = _form(w, "emulate", lambda: w.q.float().t().contiguous())  # (K, N) the e4m3 values
    return _epilogue(x8 @ wf, _form(w, "x_scale", w.x_scale), w, bias, post)


def _fp8_scaled_mm(w: QuantWeight, x: torch.Tensor, bias, post=None):
    x8 = _fp8_quantize(x, w)
    wt = _form(w, "scaled_mm", lambda: w.q.contiguous().t())  # (K, N) column-major, as _scaled_mm wants
    scale_a = _form(w, "scale_a", lambda: w.x_scale().reshape(()).to(x.device))
    scale_b = _form(w, "scale_b", lambda: w.w_scale.reshape(()).to(x.device))
    y = torch._scaled_mm(x8, wt, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    y = y.float()
    return _post(y if bias is None else y.add_(bias), post)


@torch.library.custom_op("flashrt::fp8_qdq", mutates_args=())
def fp8_qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3(clamp(x / scale, +-448)) * scale in float32: an fp8 activation quantize -> dequantize as one
    op, which the ONNX export writes as QuantizeLinear / DequantizeLinear (float8e4m3fn, saturating)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


@fp8_qdq.register_fake
def _(x, scale):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op("flashrt::fp8_dequant", mutates_args=())
def fp8_dequant(w: torch.Tensor, scale: float, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows [r0, r1) and columns [c0, c1) of an e4m3 weight times its per-tensor scale, in float32
    (exported as DequantizeLinear, then a Slice of the float result: ONNX has no float8 Slice)."""
    return (w.float() * scale)[r0:r1, c0:c1].contiguous()


@fp8_dequant.register_fake
def _(w, scale, r0, r1, c0, c1):
    return torch.empty((r1 - r0, c1 - c0), dtype=torch.float32, device=w.device)


def _fp8_qdq(w: QuantWeight, x: torch.Tensor, bias, post=None):
    """The portable form of an fp8 GEMM (`portable`): the activation quantize -> dequantize and the weight
    dequantize as two ops the ONNX export writes as Q/DQ carrying the calibrated scales (TensorRT builds
    an FP8 engine from them), then a float GEMM; equal to ``emulate`` within float32 rounding."""
    window = _window(w.q)
    if window is None:
        raise ValueError(f"{w.site or 'an fp8 GEMM'}: a strided slice of an fp8 weight has no ONNX form")
    base, r0, r1, c0, c1 = window
    xd = fp8_qdq(x.float(), w.x_scale_value)
    return _post(F.linear(xd, fp8_dequant(base, w.w_scale_value, r0, r1, c0, c1), bias), post)


def _scaled_mm_ok(w: QuantWeight, x: torch.Tensor) -> bool:
    k, n = x.shape[1], w.q.shape[0]
    return x.device.type == "cuda" and k % 16 == 0 and n % 16 == 0 and w.w_scale.dim() == 0


FP8_KERNELS: dict[str, Kernel] = {
    "scaled_mm": Kernel("scaled_mm", _fp8_scaled_mm, _scaled_mm_ok, "CUDA fp8 GEMM, torch._scaled_mm"),
    "emulate": Kernel("emulate", _fp8_emulate, _anywhere,
                      "e4m3 quantize -> dequantize, float32 GEMM (the exact CPU emulation)"),
    "qdq": Kernel("qdq", _fp8_qdq, _never, "portable: fp8 Q/DQ ops around a float GEMM (ONNX export)"),
}
PORTABLE = {"int8": "qdq", "fp8": "qdq"}  # the kernel each kind runs inside `portable()`
KERNELS = {"int8": INT8_KERNELS, "fp8": FP8_KERNELS}


# ------------------------------------------------------------------------------------- kernel table
@dataclass
class KernelTable:
    """Which kernel runs each GEMM shape, decided by measurement (like the CPU conv policies).

    Inside `tuning()` (at load), the first call of each (device, kind, mode, M, K, N) times every
    applicable kernel and keeps the fastest (`measured` holds the microseconds). Outside, a known
    shape uses its choice; an unknown M takes the choice of the nearest measured M of the same
    (K, N); a shape never measured is measured then (counted in `late`).

    The modes (`tuning`, `portable`) are per thread: an ONNX export recording on one thread does not
    switch the GEMMs another thread serves with the same table to their portable form."""

    choice: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    late: int = 0
    reps: int = 3
    modes: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    @property
    def tuning(self) -> bool:
        """Inside `tuning()` on this thread."""
        return getattr(self.modes, "tuning", False)

    @property
    def portable(self) -> bool:
        """Inside `portable()` on this thread."""
        return getattr(self.modes, "portable", False)

    def choose(self, w: QuantWeight, x: torch.Tensor) -> str:
        if self.portable:
            return PORTABLE[w.kind]
        key = (x.device.type, w.kind, w.mode, x.shape[0], x.shape[1], w.q.shape[0])
        if key in self.choice:
            return self.choice[key]
        if not self.tuning:
            near = self._nearest(key)
            if near is not None:
                return near
            self.late += 1
        return self._measure(key, w, x)

    def _nearest(self, key: tuple) -> str | None:
        same = [(abs(k[3] - key[3]), name) for k, name in self.choice.items() if k[:3] == key[:3]
                and k[4:] == key[4:]]
        return min(same)[1] if same else None

    def _measure(self, key: tuple, w: QuantWeight, x: torch.Tensor) -> str:
        times = {}
        for name in self._survivors(w, x):
            times[name] = _time(KERNELS[w.kind][name], w, x, self.reps, min(times.values(), default=None))
        if not times:
            raise RuntimeError(f"no {w.kind} kernel applies to {tuple(x.shape)} x {tuple(w.q.shape)}")
        best = min(times, key=times.get)
        self.choice[key], self.measured[key] = best, {k: round(v * 1e6, 1) for k, v in times.items()}
        return best

    def _survivors(self, w: QuantWeight, x: torch.Tensor, probe_rows: int = 32) -> list[str]:
        """The applicable kernels, less those 3x slower than the best on a few rows (one call each):
        a scalar fallback is then never run at full size."""
        names = [n for n, k in KERNELS[w.kind].items() if k.applies(w, x)]
        probe = x[:probe_rows]
        if len(names) < 2 or probe.shape[0] == x.shape[0]:
            return names
        usable = [n for n in names if KERNELS[w.kind][n].applies(w, probe)]
        quick = {n: _time(KERNELS[w.kind][n], w, probe, 0, None) for n in usable}
        best = min(quick.values(), default=0.0)
        return [n for n in names if n not in quick or quick[n] <= 3 * best]

    def report(self) -> list[dict]:
        return [{"device": k[0], "kind": k[1], "mode": k[2], "M": k[3], "K": k[4], "N": k[5],
                 "kernel": self.choice[k], "us": self.measured.get(k, {})} for k in sorted(self.choice)]


def _time(kernel: Kernel, w: QuantWeight, x: torch.Tensor, reps: int, best: float | None) -> float:
    """Seconds per call: min over a first (cold) call and ``reps`` more; a kernel 3x slower than
    ``best`` on its first call is not run again (torch._int_mm's CPU fallback can be 100x slower)."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    out = float("inf")
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        kernel.run(w, x, None)
        sync()
        out = min(out, time.perf_counter() - start)
        if best is not None and out > 3 * best:
            break
    return out


TABLE = KernelTable()


@contextlib.contextmanager
def _flag(table: KernelTable | None, name: str) -> Iterator[KernelTable]:
    """Set the table's mode ``name`` on this thread inside the block (restored after, nesting included)."""
    table = table or TABLE
    before = getattr(table.modes, name, False)
    setattr(table.modes, name, True)
    try:
        yield table
    finally:
        setattr(table.modes, name, before)


def tuning(table: KernelTable | None = None) -> contextlib.AbstractContextManager[KernelTable]:
    """Measure the kernel of every new GEMM shape run inside the block (at load, eager)."""
    return _flag(table, "tuning")


def portable(table: KernelTable | None = None) -> contextlib.AbstractContextManager[KernelTable]:
    """Inside the block every quantized GEMM runs its portable form (`PORTABLE`): int8 as Q/DQ around a
    float GEMM, which the ONNX exporter writes as QuantizeLinear / DequantizeLinear with the calibrated
    scales (`flashrt.runtime.onnx_export.record` enters it); fp8 likewise with float8e4m3fn Q/DQ."""
    return _flag(table, "portable")


def onnx_translations() -> dict[Any, Callable[..., Any]]:
    """The ONNX forms of the fp8 portable form's ops (`fp8_qdq`, `fp8_dequant`): float8e4m3fn
    QuantizeLinear / DequantizeLinear with the calibrated scale (zero point 0, saturating); the
    dequantized weight's block as a Slice of the float result (ONNX has no float8 Slice)."""
    import onnx
    from onnxscript import opset19 as op

    zero = onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])

    def qdq(x, scale: float):
        s = op.Constant(value_float=scale)
        return op.DequantizeLinear(op.QuantizeLinear(x, s, op.Constant(value=zero)), s)

    def dequant(w, scale: float, r0: int, r1: int, c0: int, c1: int):
        full = op.DequantizeLinear(w, op.Constant(value_float=scale))
        return op.Slice(full, op.Constant(value_ints=[r0, c0]), op.Constant(value_ints=[r1, c1]),
                        op.Constant(value_ints=[0, 1]))

    return {fp8_qdq._opoverload: qdq, fp8_dequant._opoverload: dequant}


# the quantized GEMM as an op: its reference is the float GEMM it stands in for (what the calibration
# gate measures it against); its forms are chosen per shape by measurement (`KernelTable`), its export
# form is `portable` (entered by `flashrt.ops.portable_forms`) with `onnx_translations`
QUANT_GEMM = register(Op("quant_gemm", F.linear, reference_name="float", portable=portable,
                         translations=onnx_translations))


# ------------------------------------------------------------------------------- making and installing
def quantize_weight(w: torch.Tensor, kind: str, x_amax: torch.Tensor | None, *, mode: str = "static",
                    qa: float | None = None, site: str = "") -> QuantWeight:
    """A float (out, in) weight -> `QuantWeight` (int8 per channel; fp8 per tensor)."""
    if mode not in MODES:
        raise ValueError(f"unknown activation mode {mode!r}; use one of {list(MODES)}")
    if kind == "fp8" and mode != "static":
        raise ValueError("fp8 activations use static calibrated scales only")
    if mode == "static" and x_amax is None:
        raise ValueError(f"{site or 'weight'}: static activations need a calibrated amax")
    wf = w.detach().float()
    if kind == "int8":
        a = wf.abs().amax(dim=1)
        s = torch.where(a > 0, a / W_QMAX, torch.ones_like(a))
        q = torch.round(wf / s[:, None]).clamp_(-W_QMAX, W_QMAX).to(torch.int8)
        qa = qa if qa is not None else activation_qmax(w.device)
    elif kind == "fp8":
        a = wf.abs().amax()
        s = torch.where(a > 0, a / FP8_MAX, torch.ones_like(a))
        q = (wf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        qa = FP8_MAX
    else:
        raise ValueError(f"unknown quantized kind {kind!r}; use 'int8' or 'fp8'")
    amax = None if x_amax is None else torch.as_tensor(x_amax, dtype=torch.float32, device=w.device)
    return QuantWeight(q, s, amax, kind=kind, qa=qa, mode=mode, dtype=w.dtype, site=site)


def swap_weight(linear: nn.Linear, weight: torch.Tensor) -> torch.Tensor:
    """Put ``weight`` (a QuantWeight, an observing weight, or the original Parameter back) in ``linear``;
    returns what was there."""
    old = linear._parameters.pop("weight", None)
    if old is None:
        old = linear.__dict__.pop("weight")
    if isinstance(weight, nn.Parameter):
        linear._parameters["weight"] = weight
    else:
        object.__setattr__(linear, "weight", weight)
    return old


def install(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Swap the weights of the named ``nn.Linear`` modules; returns the previous ones (for `install`
    again to undo)."""
    modules = dict(model.named_modules())
    return {name: swap_weight(modules[name], w) for name, w in weights.items()}


# ------------------------------------------------------------------------------------- observation
class ObservedWeight(torch.Tensor):
    """A float weight that records max |x| of every ``F.linear`` input (calibration; slices share it)."""

    site: str
    record: Callable[[str, torch.Tensor], None]

    @staticmethod
    def __new__(cls, w: torch.Tensor, site: str, record: Callable[[str, torch.Tensor], None]):
        self = w.detach().as_subclass(cls)
        self.site, self.record = site, record
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        w = args[1] if func is F.linear else (_weight_arg(func, args) if name in _FUSED else None)
        if isinstance(w, ObservedWeight):
            w.record(w.site, args[0])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], ObservedWeight):
            return ObservedWeight(out, args[0].site, args[0].record)
        return out
