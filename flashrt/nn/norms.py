"""RMSNorm of every decoder family (Gemma, Llama, Qwen2/3, Qwen3-VL text) and Pi0.5's adaptive form.

Shapes: ``x`` (..., D); ``cond`` (..., C); modulation tables (..., 3, D) ordered scale | shift | gate.

* `RMSNorm`: ``x / rms(x) * g``, statistics in float32, the result in ``x``'s dtype; two flags name
  the family forms. ``offset``: ``g = 1 + w`` (Gemma; ``w`` zero at init) or ``g = w`` (Llama, Qwen;
  ones at init). ``cast_first``: the normalized x is rounded to x's dtype before ``g`` multiplies it
  (transformers' Llama / Qwen3 ``w * normalize(x).to(dtype)``), else the product runs in float32 and is
  rounded once (Gemma; GR00T's Qwen3-VL text layers); in float32 the two are the same. ``g`` is a
  derived float32 table (``scale``), computed from the loaded weight by `RMSNorm.reset_derived` (which
  `flashrt.io.load_module` calls; call it again after changing ``weight`` or the module's dtype),
  never per call; the layers pass it to the decoder ops (`flashrt.ops.decoder`), one kernel on a GPU.
* `AdaRMSNorm`: Pi0.5's adaptive RMSNorm. A linear map of the conditioning vector gives
  ``scale | shift | gate`` (each D wide); the norm is ``x / rms(x) * (1 + scale) + shift`` and the gate
  multiplies the branch output before the residual add (`gated_residual`). The conditioning of Pi0.5 is
  a function of the flow-matching time only, so a model can compute the modulation once per schedule
  (`AdaRMSNorm.modulation`) and pass it to `AdaRMSNorm.forward` on every step.
* `rms_norm_ref` / `add_rms_norm_ref`: the two forms as functions of a (scale, shift) row, the second
  with the residual add before it; the references of the fused ``flashrt::rms_norm`` /
  ``flashrt::add_rms_norm`` ops, defined with them in `flashrt.ops.decoder`.
"""

from __future__ import annotations

import torch
from torch import nn

from flashrt.ops.decoder import add_rms_norm_ref, gated_residual, rms_norm_ref, rms_normalize

__all__ = ["AdaRMSNorm", "RMSNorm", "add_rms_norm_ref", "gated_residual", "rms_norm_ref", "rms_normalize"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y if y.dtype == dtype else y.to(dtype)


class RMSNorm(nn.Module):
    """The one RMSNorm (module docstring): ``offset`` True is Gemma's ``1 + weight`` (zero at init),
    False a plain ``weight`` (ones at init); ``cast_first`` the Llama rounding. ``scale``: the derived
    float32 gain (`reset_derived`)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = True, cast_first: bool = False) -> None:
        super().__init__()
        self.eps, self.offset, self.cast_first = eps, offset, cast_first
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.register_buffer("scale", torch.ones(dim), persistent=False)

    def reset_derived(self) -> None:
        """``scale = [1 +] weight`` in float32, as the reference computes it on every call."""
        w = _f32(self.weight.detach())
        self.scale = 1.0 + w if self.offset else w.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.scale, None, self.eps, self.cast_first)

    def extra_repr(self) -> str:
        flags = "".join(f", {k}" for k in ("offset", "cast_first") if getattr(self, k))
        return f"{self.weight.shape[0]}, eps={self.eps}{flags}"


class AdaRMSNorm(nn.Module):
    """Adaptive RMSNorm: ``dense(cond)`` → scale | shift | gate (Pi0.5 action expert)."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., 3, D) float32 table: ``1 + scale``, shift, gate (precomputable per schedule)."""
        mod = self.dense(cond.to(self.dense.weight.dtype)).float().unflatten(-1, (3, self.dim))
        return torch.stack((1.0 + mod[..., 0, :], mod[..., 1, :], mod[..., 2, :]), dim=-2)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (B, L, D), ``mod`` (3, D) or (B, 1, 3, D) from `modulation` -> (normed, gate), x's dtype."""
        one_plus_scale, shift, gate = mod.unbind(-2)
        return rms_norm_ref(x, one_plus_scale, shift, self.eps), _cast(gate, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, adaptive"
