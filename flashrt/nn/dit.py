"""Diffusion-transformer blocks of the GR00T action heads (diffusers' BasicTransformerBlock as GR00T uses it).

Shapes: B batch, T action-side tokens, S conditioning tokens, E inner width (heads x head_dim), K
conditioning width, N flow-matching steps.

A block is: norm1 → attention (self, or cross to S conditioning tokens with a key mask) → residual →
norm3 → tanh-GELU feed-forward (4E) → residual. norm1 is either an affine LayerNorm (the VL
self-attention stack) or GR00T's AdaLayerNorm: ``LN(x) * (1 + scale) + shift`` with
``scale | shift = Linear(silu(temb))``. The timestep embedding of a flow-matching step depends only on
the step index, so a head evaluates every block's modulation for a fixed schedule once (load time,
``DiTBlock.norm1_mod``) instead of on every call. Cross-attention K/V depend only on the conditioning
tokens, so `DiTBlock.cross_kv` computes them once per observation and every step reuses them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """diffusers ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=1)``: (N,) -> (N, dim)."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)


class DiTBlock(nn.Module):
    """One transformer block; ``ada`` selects AdaLayerNorm (needs a (B, 2E) modulation) for norm1."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, cross_dim: int | None, ada: bool, affine_norm3: bool
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.ada = heads, head_dim, ada
        inner = heads * head_dim
        if ada:
            self.norm1_linear = nn.Linear(dim, 2 * dim)
        else:
            self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(cross_dim or dim, inner)
        self.to_v = nn.Linear(cross_dim or dim, inner)
        self.to_out = nn.Linear(inner, dim)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=affine_norm3)
        self.ff_in = nn.Linear(dim, 4 * dim)
        self.ff_out = nn.Linear(4 * dim, dim)
        self.is_cross = cross_dim is not None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def cross_kv(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, K) conditioning -> K, V (B, heads, S, head_dim)."""
        return self._heads(_linear(cond, self.to_k)), self._heads(_linear(cond, self.to_v))

    def norm1_mod(self, temb: torch.Tensor) -> torch.Tensor:
        """(N, E) timestep embeddings -> (N, 2, E) ``1 + scale``, ``shift``."""
        scale, shift = _linear(F.silu(temb), self.norm1_linear).chunk(2, dim=-1)
        return torch.stack([1.0 + scale, shift], dim=1)

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, E); mod (2, E) from `norm1_mod` (ada blocks); kv from `cross_kv` (cross blocks) or
        None (self-attention); mask (B, 1, 1, S) bool key mask, its additive bias (0 / -inf, x's dtype:
        the same result, converted once by the caller) or None."""
        if self.ada:
            h = torch.addcmul(mod[1], F.layer_norm(x, x.shape[-1:], eps=1e-5), mod[0])
        else:
            h = self.norm1.forward(x)
        q = self._heads(_linear(h, self.to_q))
        k, v = (
            kv if kv is not None else (self._heads(_linear(h, self.to_k)), self._heads(_linear(h, self.to_v)))
        )
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = _linear(a.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1), self.to_out).add_(x)
        h = F.gelu(_linear(self.norm3.forward(x), self.ff_in), approximate="tanh")
        return _linear(h, self.ff_out).add_(x)
