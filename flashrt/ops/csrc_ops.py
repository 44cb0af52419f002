"""CUDA implementations of the ``flashrt::`` custom ops over the csrc library's C ABI
(`flashrt.ops.csrc`).

Each method takes the op's arguments, checks what its kernel handles (dtype float32 / bfloat16 /
float16 shared by the activations, contiguous rows, (D,) float32 scale and shift, (D,) gate in the
activation dtype, last dims contiguous for RoPE), allocates the outputs with torch and launches on
torch's current stream of the tensors' device (so a CUDA graph captures it); anything else runs the
reference of `flashrt.ops.decoder`, which is always correct. Shapes: as in `flashrt.ops.decoder`.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from flashrt.ops.decoder import add_rms_norm_ref, gelu_mul_ref, rms_norm_ref, rope_qkv_ref, silu_mul_ref

__all__ = ["CudaOps", "CUDA_FORMS", "gelu_mul_takes", "norm_takes", "rope_qkv_takes", "row_layout"]

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "flashrt_add_rms_norm": (_I, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _F, _I, _I64, _I64, _P),
    "flashrt_rope_qkv": (_I, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64,
                         _I64, _I64, _I64, _I64, _I, _I, _I64, _P),
    "flashrt_gelu_mul": (_I, _P, _P, _I64, _I64, _P),
    "flashrt_silu_mul": (_I, _P, _P, _I64, _I64, _P),
}


def _shaped_vector(v: Tensor | None, dim: int, dtype: torch.dtype) -> bool:
    return v is None or (v.shape == (dim,) and v.dtype == dtype and v.is_contiguous())


def row_layout(x: Tensor) -> tuple[int, int] | None:
    """(inner, outer_stride) of x's rows for the norm kernel: contiguous (1, D), or groups of the
    second-to-last dim's contiguous rows a fixed stride apart (q of a fused qkv split); None: neither."""
    d = x.shape[-1]
    if x.is_contiguous():
        return 1, d
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) != d:
        return None
    try:
        groups = x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None
    return x.shape[-2], groups.stride(0)


def norm_takes(x: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor, shift: Tensor | None) -> bool:
    """Whether the norm kernel takes these arguments' shapes, dtypes and layouts (any device): x with
    contiguous rows (`row_layout`; contiguous when a residual y comes with it)."""
    d = x.shape[-1] if x.dim() else 0
    same = y is None or (y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous())
    rows_ok = x.is_contiguous() if y is not None else (d > 0 and row_layout(x) is not None)
    return (x.dtype in DTYPES and rows_ok and d > 0 and same and _shaped_vector(gate, d, x.dtype)
            and _shaped_vector(scale, d, torch.float32) and _shaped_vector(shift, d, torch.float32))


def rope_qkv_takes(qkv: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor, v_out: Tensor, heads: int) -> bool:
    """Whether the RoPE kernel takes these arguments (any device)."""
    b, length, total, d = qkv.shape
    kv = k_out.shape[2]
    ok = (qkv.dtype in DTYPES and all(t.dtype == qkv.dtype and t.dim() == 4 and t.stride(-1) == 1
                                      for t in (qkv, cos, sin, k_out, v_out))
          and total == heads + 2 * kv and k_out.shape == v_out.shape == (b, length, kv, d)
          and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.shape[2] == 1
          and cos.shape[-1] == d and d % 2 == 0)
    try:
        return ok and cos.expand(b, length, 1, d) is not None
    except RuntimeError:
        return False


def gelu_mul_takes(gate_up: Tensor) -> bool:
    """Whether the gated-MLP product kernels (GeGLU, SwiGLU) take ``gate_up`` (any device)."""
    return gate_up.dtype in DTYPES and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0


# op name (as the dispatcher names it) -> (whether its CUDA kernel takes the call, its reference): what
# `flashrt.profile.kernels` counts a custom op by (one kernel, or the reference's ops)
CUDA_FORMS = {
    "flashrt.rms_norm.default": (lambda x, scale, shift, *_: norm_takes(x, None, None, scale, shift),
                                 rms_norm_ref),
    "flashrt.add_rms_norm.default": (lambda x, y, gate, scale, shift, *_: norm_takes(x, y, gate, scale,
                                                                                       shift),
                                     add_rms_norm_ref),
    "flashrt.rope_qkv.default": (rope_qkv_takes, rope_qkv_ref),
    "flashrt.gelu_mul.default": (gelu_mul_takes, gelu_mul_ref),
    "flashrt.silu_mul.default": (gelu_mul_takes, silu_mul_ref),
}


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CudaOps:
    """The CUDA kernels of the custom ops, bound to one loaded csrc library."""

    def __init__(self, handle: ctypes.CDLL) -> None:
        self.fns = {}
        for name, argtypes in SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self.fns[name] = fn

    def _launch(self, name: str, device: torch.device, *args) -> None:
        with torch.cuda.device(device):
            rc = self.fns[name](*args, torch.cuda.current_stream(device).cuda_stream)
        if rc != 0:
            raise RuntimeError(f"csrc {name}: CUDA error {rc} ({torch.cuda.get_device_name(device)})")

    # ---------------------------------------------------------------------------------- norms
    def _norm_ok(self, x: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor,
                 shift: Tensor | None) -> bool:
        on_gpu = all(t is None or t.is_cuda for t in (x, gate, scale, shift))
        return on_gpu and norm_takes(x, y, gate, scale, shift)

    def _norm(self, x: Tensor, y: Tensor | None, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
              eps: float, cast_first: bool) -> tuple[Tensor | None, Tensor]:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s = None if y is None else torch.empty_like(x)
        d = x.shape[-1]
        inner, outer = row_layout(x)
        self._launch("flashrt_add_rms_norm", x.device, DTYPES[x.dtype], _ptr(x), _ptr(y), _ptr(gate),
                     _ptr(scale), _ptr(shift), _ptr(s), _ptr(out), x.numel() // d, d, float(eps),
                     int(cast_first), inner, outer)
        return s, out

    def rms_norm(self, x: Tensor, scale: Tensor, shift: Tensor | None, eps: float,
                 cast_first: bool = False) -> Tensor:
        if not self._norm_ok(x, None, None, scale, shift):
            return rms_norm_ref(x, scale, shift, eps, cast_first)
        return self._norm(x, None, None, scale, shift, eps, cast_first)[1]

    def add_rms_norm(self, x: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
                     eps: float, cast_first: bool = False) -> tuple[Tensor, Tensor]:
        if not self._norm_ok(x, y, gate, scale, shift):
            return add_rms_norm_ref(x, y, gate, scale, shift, eps, cast_first)
        return self._norm(x, y, gate, scale, shift, eps, cast_first)

    # ---------------------------------------------------------------------------------- RoPE
    def rope_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor, v_out: Tensor,
                 heads: int) -> Tensor:
        b, length, _, d = qkv.shape
        kv = k_out.shape[2]
        on_gpu = all(t.is_cuda for t in (qkv, cos, sin, k_out, v_out))
        if not (on_gpu and rope_qkv_takes(qkv, cos, sin, k_out, v_out, heads)):
            return rope_qkv_ref(qkv, cos, sin, k_out, v_out, heads)
        rope = cos.expand(b, length, 1, d)
        q = qkv.new_empty((b, length, heads, d))
        self._launch("flashrt_rope_qkv", qkv.device, DTYPES[qkv.dtype], _ptr(qkv), *qkv.stride()[:3],
                     _ptr(cos), _ptr(sin), *rope.stride()[:2], _ptr(q), _ptr(k_out), *k_out.stride()[:3],
                     _ptr(v_out), *v_out.stride()[:3], b, length, heads, kv, d)
        return q

    # ---------------------------------------------------------------------------------- GeGLU
    def _act_mul(self, name: str, gate_up: Tensor) -> Tensor:
        m = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], m))
        self._launch(name, gate_up.device, DTYPES[gate_up.dtype], _ptr(gate_up), _ptr(out),
                     gate_up.numel() // (2 * m) if m else 0, m)
        return out

    def gelu_mul(self, gate_up: Tensor) -> Tensor:
        if not gelu_mul_takes(gate_up):
            return gelu_mul_ref(gate_up)
        return self._act_mul("flashrt_gelu_mul", gate_up)

    # ---------------------------------------------------------------------------------- SwiGLU
    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if not gelu_mul_takes(gate_up):
            return silu_mul_ref(gate_up)
        return self._act_mul("flashrt_silu_mul", gate_up)
