"""Normalization layers of the Gemma / PaliGemma family.

Shapes: ``x`` (..., D); ``cond`` (..., C); modulation tables (..., 3, D) ordered scale | shift | gate.

* `RMSNorm`: Gemma's ``x / rms(x) * (1 + w)``. Statistics and the scale run in float32; the result is
  cast back to ``x``'s dtype (Gemma multiplies before the downcast, unlike Llama). ``1 + w`` is a
  derived float32 table (``scale``), computed from the loaded weight by `RMSNorm.reset_derived` (which
  `flashrt.io.load_module` calls; call it again after changing ``weight`` or the module's dtype),
  never per call.
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
    """Gemma RMSNorm with the (1 + weight) parametrization; ``weight`` is zero at init, ``scale`` the
    derived float32 ``1 + weight`` (`reset_derived`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.register_buffer("scale", torch.ones(dim), persistent=False)

    def reset_derived(self) -> None:
        """``scale = 1 + weight`` in float32, as the reference computes it on every call."""
        self.scale = 1.0 + _f32(self.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.scale, None, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


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
