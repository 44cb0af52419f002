"""Fused ops of the decoder hot path: one kernel each on a GPU, a pure-torch reference everywhere else.

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

Each op has three implementations:

* the reference (``*_ref``): the exact composition of ATen ops the unfused model ran, so every result
  on the CPU is unchanged (tests compare it with the unfused modules bit for bit);
* a fake (shapes only), so the meta device and `flashrt.profile.kernels` see ONE kernel, which is what
  a CUDA build launches;
* a CUDA kernel (csrc/, loaded and registered by `flashrt.runtime.csrc`) where the csrc library is
  built; elsewhere the custom op runs the reference.

They are registered with torch.library as ``flashrt::<name>`` custom ops (so graph capture, the trace
backend and torch.compile see one opaque op). `KERNELS` is the table modules dispatch through by name:
"aten" calls the references directly (no dispatcher hop, less host time per call: the CPU
default, and CUDA without the library), "fused" calls the custom ops. `resolve_kernels` picks at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from flashrt.errors import ConfigError
from flashrt.nn.norms import add_rms_norm_ref, rms_norm_ref
from flashrt.nn.rope import apply_rope

__all__ = ["KERNELS", "KERNEL_CHOICES", "Ops", "NormRow", "resolve_kernels", "use_kernels",
           "rms_norm_ref", "add_rms_norm_ref", "rope_qkv_ref", "gelu_mul_ref", "silu_mul_ref"]

KERNEL_CHOICES = ("auto", "aten", "fused")


class NormRow(NamedTuple):
    """One norm's parameters for a call: scale (D,) float32, shift (D,) float32 or None (plain RMSNorm),
    gate (D,) in the activation dtype or None: what multiplies the branch before the residual add."""

    scale: Tensor
    shift: Tensor | None = None
    gate: Tensor | None = None


# ------------------------------------------------------------------------------------------ references
# rms_norm_ref, add_rms_norm_ref: flashrt.nn.norms (the norms' own forms)
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


# ------------------------------------------------------------------------------------------ kernel table
@dataclass(frozen=True)
class Ops:
    """One row of the kernel table: how each fused op runs."""

    rms_norm: Any
    add_rms_norm: Any
    rope_qkv: Any
    gelu_mul: Any
    silu_mul: Any


KERNELS: dict[str, Ops] = {
    "aten": Ops(rms_norm_ref, add_rms_norm_ref, rope_qkv_ref, gelu_mul_ref, silu_mul_ref),
    "fused": Ops(torch.ops.flashrt.rms_norm, torch.ops.flashrt.add_rms_norm, torch.ops.flashrt.rope_qkv,
                 torch.ops.flashrt.gelu_mul, torch.ops.flashrt.silu_mul),
}


def resolve_kernels(choice: str, device: torch.device | str) -> str:
    """"aten" or "fused" for a load option: "auto" is "fused" on a CUDA device where the csrc library
    loads (`flashrt.runtime.csrc.load`, built on first use where a CUDA toolkit is), else "aten"."""
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"kernels={choice!r}; choose one of {KERNEL_CHOICES}")
    if choice != "auto":
        return choice
    if torch.device(device).type != "cuda":
        return "aten"
    from flashrt.runtime import csrc

    return "fused" if csrc.load() is not None else "aten"


def use_kernels(module: torch.nn.Module, name: str) -> None:
    """Run every submodule of ``module`` that dispatches through `KERNELS` with the row ``name``."""
    if name not in KERNELS:
        raise ConfigError(f"unknown kernel table row {name!r}; known: {sorted(KERNELS)}")
    for sub in module.modules():
        if hasattr(sub, "kernels"):
            sub.kernels = name
