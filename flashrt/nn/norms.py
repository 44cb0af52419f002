"""Normalization layers of the Gemma / PaliGemma family.

Shapes: ``x`` (..., D); ``cond`` (..., C); modulation tables (..., 3, D) ordered scale | shift | gate.

* `RMSNorm`: Gemma's ``x / rms(x) * (1 + w)``. Statistics and the scale run in float32; the result is
  cast back to ``x``'s dtype (Gemma multiplies before the downcast, unlike Llama).
* `AdaRMSNorm`: Pi0.5's adaptive RMSNorm. A linear map of the conditioning vector gives
  ``scale | shift | gate`` (each D wide); the norm is ``x / rms(x) * (1 + scale) + shift`` and the gate
  multiplies the branch output before the residual add (`gated_residual`). The conditioning of Pi0.5 is
  a function of the flow-matching time only, so a model can compute the modulation once per schedule
  (`AdaRMSNorm.modulation`) and pass it to `AdaRMSNorm.forward` on every step.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, computed in float32 (returns float32)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm with the (1 + weight) parametrization; ``weight`` is zero at init."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

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
        y = rms_normalize(x, self.eps) * one_plus_scale + shift
        return y.to(x.dtype), gate.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, adaptive"


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``x + y`` or, with an adaRMS gate, ``x + y * gate``."""
    return x + y if gate is None else x + y * gate
