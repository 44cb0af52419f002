"""Rotary position embeddings (the "rotate half" convention of Gemma / Llama in transformers).

Shapes: B batch, L tokens, H heads, D head_dim; ``positions`` (B, L) integer or float.
``rope_cos_sin`` returns full-width tables (B, L, 1, D) that broadcast over the heads of ``x``
(B, L, H, D): ``cos = [c | c]`` and a signed ``sin = [-s | s]`` (c, s of the angles of the D/2
frequencies). Dimension i pairs with i + D/2, and with ``swap(x) = [x2 | x1]`` (x1, x2 the halves of x)
the rotation is ``x * cos + swap(x) * sin``, i.e. ``out[:D/2] = x1 c - x2 s``, ``out[D/2:] = x2 c + x1 s``:
the reference's ``x * cos + rotate_half(x) * sin`` with the sign folded into the table, so a rotation is
three ops (mul, roll, addcmul) and can write straight into a destination such as a K/V cache slot.
Positions are tensors, so tables built from masks (``cumsum(valid) - 1``) need no host sync.
Tables are computed in float32 and cast to the activation dtype before use, as the reference does.
"""

from __future__ import annotations

import torch

from flashrt.ops.decoder import apply_rope, swap_halves

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq", "swap_halves"]


def rope_inv_freq(head_dim: int, theta: float = 10_000.0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies ``theta ** (-2i / D)``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float = 10_000.0, dtype: torch.dtype = torch.float32,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c | c]``, ``[-s | s]`` tables (B, L, 1, D) in ``dtype`` for integer or float positions (B, L).

    ``inv_freq``: `rope_inv_freq` (head_dim, theta) computed once on positions' device (e.g. at load:
    a captured step then does not recompute it, five kernels a call); None computes it here."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device) if inv_freq is None else inv_freq
    freqs = (positions.float()[..., None] * inv_freq)[..., None, :]  # (B, L, 1, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)
