"""The decoder hot path's ops: one CUDA kernel each where the csrc library loads, their references
everywhere else.

Shapes: x, y (..., D) rows of width D; B batch, L tokens, H query heads, KV key/value heads, D head_dim
(`rope_qkv`), M mlp width (`gelu_mul`).

    rms_norm(x, scale, shift, eps, cast_first=False) -> n
        n = x / rms(x) * scale [+ shift]: statistics and products in float32, n in x's dtype.
        scale, shift: (D,) float32 (Gemma's ``1 + w`` precomputed at load; an adaRMS table row).
        ``cast_first``: x / rms(x) rounded to x's dtype before the scale (Llama's form, `RMSNorm`).
    add_rms_norm(x, y, gate, scale, shift, eps, cast_first=False) -> (s, n)
        s = x + y [* gate] (the residual add of a pre-norm block, in x's dtype), n = rms_norm(s, ...):
        the add fused with the norm that follows it (the next layer's input norm, the final norm).
    rope_qkv(qkv, cos, sin, k_out, v_out, heads) -> q
        qkv (B, L, heads + 2 KV, D), one fused projection; q (B, L, heads, D) rotated (a new tensor),
        k rotated into ``k_out`` and v copied into ``v_out`` ((B, L, KV, D) views of any strides: the
        static K/V slots). ``heads`` 0: a K/V-only pass (q is empty). cos, sin: `flashrt.nn.rope` tables.
    gelu_mul(gate_up) -> gelu_tanh(gate_up[..., :M]) * gate_up[..., M:]          (..., 2M) -> (..., M)
    silu_mul(gate_up) -> silu(gate_up[..., :M]) * gate_up[..., M:]               (..., 2M) -> (..., M)

Each op (`RMS_NORM`, `ADD_RMS_NORM`, `ROPE_QKV`, `GELU_MUL`, `SILU_MUL`, group "decoder") has two forms:

* "aten", the reference (``*_ref``): the exact composition of ATen ops the unfused model ran, so every
  result on the CPU is unchanged (tests compare it with the unfused modules bit for bit); also what an
  export records in place of the custom op (`flashrt.ops.export_ops`);
* "fused", the ``flashrt::<name>`` custom op (torch.library: graph capture, the trace backend and
  torch.compile see one opaque op), chosen on a CUDA device where the csrc library loads
  (`flashrt.ops.csrc`, which registers its CUDA kernels; elsewhere the custom op runs the reference). Its
  fake (shapes only) lets the meta device and `flashrt.profile.kernels` see ONE kernel, which is what a
  CUDA build launches.

The reference call has no dispatcher hop (less host time per call: the CPU default, and CUDA without
the library). A load option picks with ``prefer={"decoder": "aten" | "fused"}`` (`decoder_prefer`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from flashrt.errors import ConfigError
from flashrt.ops.op import Form, Op, register

__all__ = ["ADD_RMS_NORM", "GELU_MUL", "KERNEL_CHOICES", "NormRow", "RMS_NORM", "ROPE_QKV", "SILU_MUL",
           "add_rms_norm_ref", "apply_rope", "decoder_prefer", "gated_residual", "gelu_mul_ref",
           "rms_norm_ref", "rms_normalize", "rope_qkv_ref", "silu_mul_ref", "swap_halves"]

KERNEL_CHOICES = ("auto", "aten", "fused")  # a loader's ``kernels`` option


class NormRow(NamedTuple):
    """One norm's parameters for a call: scale (D,) float32, shift (D,) float32 or None (plain RMSNorm),
    gate (D,) in the activation dtype or None: what multiplies the branch before the residual add."""

    scale: Tensor
    shift: Tensor | None = None
    gate: Tensor | None = None


# ------------------------------------------------------------------------------------------ references
def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _cast(y: Tensor, dtype: torch.dtype) -> Tensor:
    return y if y.dtype == dtype else y.to(dtype)


def rms_normalize(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """``x * rsqrt(mean(x²) + eps) [* weight]`` over the last dim, in float32 (returns float32).

    Statistics in place on the (..., 1) column, one pass for the product and one for the weight: on
    the CPU half the time of ``F.rms_norm`` at the prefix's 520 x 256 (which copies), same values."""
    x32 = _f32(x)
    y = torch.mul(x32, x32.square().mean(-1, keepdim=True).add_(eps).rsqrt_())
    return y if weight is None else y.mul_(_f32(weight))


def rms_norm_ref(x: Tensor, scale: Tensor, shift: Tensor | None, eps: float,
                 cast_first: bool = False) -> Tensor:
    """``x / rms(x) * scale [+ shift]`` in float32 (scale, shift float32), returned in x's dtype;
    ``cast_first``: the normalized x rounded to x's dtype before the scale (Llama's form; the product
    of two values of a half dtype is exact in float32, so this rounds as a product in that dtype)."""
    n = rms_normalize(x, eps)
    if cast_first:
        n = _cast(n, x.dtype)
    n = n.mul_(scale) if shift is None else torch.addcmul(shift, n, scale)
    return _cast(n, x.dtype)


def gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    """``x + y`` or, with an adaRMS gate, ``x + y * gate`` (one op either way)."""
    return x + y if gate is None else torch.addcmul(x, y, gate)


def add_rms_norm_ref(x: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
                     eps: float, cast_first: bool = False) -> tuple[Tensor, Tensor]:
    """(``s = gated_residual(x, y, gate)``, ``rms_norm_ref(s, scale, shift, eps, cast_first)``)."""
    s = gated_residual(x, y, gate)
    return s, rms_norm_ref(s, scale, shift, eps, cast_first)


def swap_halves(x: Tensor) -> Tensor:
    """``[x2 | x1]`` along the last dim (a new tensor)."""
    return x.roll(x.shape[-1] // 2, -1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """Rotate ``x`` (B, L, H, D) by the tables (B, L, 1, D) of `flashrt.nn.rope.rope_cos_sin`.

    Returns a new contiguous tensor, or writes into ``out`` (any strides, x's shape; e.g. a K/V slot)."""
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad):  # out= ops cannot record grads
        y = x * cos + swap_halves(x) * sin
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.mul(x, cos, out=out).addcmul_(swap_halves(x), sin)


def rope_qkv_ref(qkv: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor, v_out: Tensor, heads: int) -> Tensor:
    """Rotated q (B, L, heads, D); k rotated into ``k_out``, v copied into ``v_out``."""
    kv = k_out.shape[2]
    apply_rope(qkv[:, :, heads:heads + kv], cos, sin, out=k_out)
    v_out.copy_(qkv[:, :, heads + kv:])
    if heads == 0:
        return qkv.new_empty((*qkv.shape[:2], 0, qkv.shape[3]))
    return apply_rope(qkv[:, :, :heads], cos, sin)


def gelu_mul_ref(gate_up: Tensor) -> Tensor:
    """``gelu_tanh(gate) * up`` of the two halves of the last dim (the product formed in gelu's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of the two halves of the last dim (the product formed in silu's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# ------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("flashrt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, scale: Tensor, shift: Tensor | None, eps: float, cast_first: bool = False) -> Tensor:
    return rms_norm_ref(x, scale, shift, eps, cast_first)


@rms_norm.register_fake
def _(x, scale, shift, eps, cast_first=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("flashrt::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, y: Tensor, gate: Tensor | None, scale: Tensor, shift: Tensor | None,
                 eps: float, cast_first: bool = False) -> tuple[Tensor, Tensor]:
    return add_rms_norm_ref(x, y, gate, scale, shift, eps, cast_first)


@add_rms_norm.register_fake
def _(x, y, gate, scale, shift, eps, cast_first=False):
    out = torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype, device=x.device)
    return out, torch.empty_like(out)


@torch.library.custom_op("flashrt::rope_qkv", mutates_args=("k_out", "v_out"))
def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, k_out: Tensor, v_out: Tensor, heads: int) -> Tensor:
    return rope_qkv_ref(qkv, cos, sin, k_out, v_out, heads)


@rope_qkv.register_fake
def _(qkv, cos, sin, k_out, v_out, heads):
    return qkv.new_empty((*qkv.shape[:2], heads, qkv.shape[3]))


@torch.library.custom_op("flashrt::gelu_mul", mutates_args=())
def gelu_mul(gate_up: Tensor) -> Tensor:
    return gelu_mul_ref(gate_up)


@gelu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("flashrt::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    return silu_mul_ref(gate_up)


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


CUSTOM_OPS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope_qkv": rope_qkv, "gelu_mul": gelu_mul,
              "silu_mul": silu_mul}
REFERENCES = {"rms_norm": rms_norm_ref, "add_rms_norm": add_rms_norm_ref, "rope_qkv": rope_qkv_ref,
              "gelu_mul": gelu_mul_ref, "silu_mul": silu_mul_ref}


# ------------------------------------------------------------------------------------------ the ops
def csrc_loads() -> bool:
    """Whether the csrc CUDA library loads here (built on first use where a CUDA toolkit is)."""
    from flashrt.ops import csrc

    return csrc.load() is not None


def _op(name: str) -> Op:
    overload = getattr(torch.ops.flashrt, name)
    return register(Op(name, REFERENCES[name], group="decoder",
                       forms={"fused": Form(overload, device="cuda", available=csrc_loads)},
                       export_ops=lambda: {overload.default: REFERENCES[name]}))


RMS_NORM, ADD_RMS_NORM, ROPE_QKV, GELU_MUL, SILU_MUL = (_op(n) for n in ("rms_norm", "add_rms_norm",
                                                                        "rope_qkv", "gelu_mul", "silu_mul"))


def decoder_prefer(kernels: str) -> dict[str, str]:
    """The ``prefer`` of `flashrt.ops.select` for a loader's ``kernels`` option: "auto" (the fused forms
    on a CUDA device where the csrc library loads, the references elsewhere), "aten", "fused"."""
    if kernels not in KERNEL_CHOICES:
        raise ConfigError(f"kernels={kernels!r}; choose one of {KERNEL_CHOICES}")
    return {} if kernels == "auto" else {"decoder": kernels}
