"""SigLIP2 (NaFlex) vision tower for a fixed patch grid: the vision encoder of Eagle 3 VL (GR00T N1.6).

Shapes: I images, R x Q image size (multiples of P), P patch side, gh x gw = (R/P) x (Q/P) patches,
g = gh * gw, C width. Pixels are already normalized.

Differences from transformers' ``Siglip2VisionModel``, all exact re-arrangements for a grid fixed at
load (every image of a call the same size, no padding patches):

* The patch embedding is a Linear over flattened (row, column, channel) patches; applied to a whole
  image it is a stride-P convolution whose kernel is the Linear's weight viewed as (C, P, P, 3) and
  permuted to (C, 3, P, P) (`reset_derived`), so images go in as (I, 3, R, Q), not as patch lists.
* The learned side x side position grid is resized to gh x gw (bilinear, antialiased, float32, as the
  reference) once per grid (`position_table`), not on every call.
* The encoder layers and the post LayerNorm are SigLIP's (`flashrt.nn.siglip.SiglipLayer`); the
  pooling head is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.nn.siglip import SiglipLayer


class Siglip2Vision(nn.Module):
    """(I, 3, R, Q) pixels + a `position_table` -> (I, g, C) last hidden state (post LayerNorm)."""

    def __init__(
        self,
        width: int,
        depth: int,
        mlp_dim: int,
        num_heads: int,
        patch: int,
        num_patches: int,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.patch, self.width = patch, width
        self.side = int(round(num_patches**0.5))
        self.patch_embedding = nn.Linear(3 * patch * patch, width)
        self.position_embedding = nn.Embedding(num_patches, width)
        self.layers = nn.ModuleList(SiglipLayer(width, mlp_dim, num_heads, eps) for _ in range(depth))
        self.post_norm = nn.LayerNorm(width, eps=eps)
        self.register_buffer("patch_conv", torch.empty(width, 3, patch, patch), persistent=False)

    def reset_derived(self) -> None:
        p = self.patch
        self.patch_conv = (
            self.patch_embedding.weight.view(self.width, p, p, 3).permute(0, 3, 1, 2).contiguous()
        )

    def position_table(self, gh: int, gw: int) -> torch.Tensor:
        """(g, C): the position grid resized to gh x gw, row-major."""
        grid = self.position_embedding.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        out = F.interpolate(grid, size=(gh, gw), mode="bilinear", align_corners=False, antialias=True)
        return out.reshape(self.width, gh * gw).T.to(self.position_embedding.weight.dtype)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(
            pixels.to(self.patch_conv.dtype), self.patch_conv, self.patch_embedding.bias, stride=self.patch
        )
        x = x.flatten(2).transpose(1, 2) + positions  # (I, g, C)
        for layer in self.layers:
            x = layer.forward(x)
        return self.post_norm.forward(x)
