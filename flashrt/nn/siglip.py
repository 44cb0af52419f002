"""SigLIP vision tower as PaliGemma uses it: patch embedding, pre-norm ViT encoder, post LayerNorm.

Shapes: I images, C=3 channels, R image side, P patch side, N = (R/P)² tokens, W width, H heads,
D = W/H head_dim, M mlp_dim. Input pixels are already normalized to [-1, 1].

There is no pooling head (PaliGemma reads the last hidden state). q|k|v are one fused projection
``qkv`` (W -> 3W, with bias); the weight map concatenates the checkpoint's separate matrices. The
attention reads q, k, v as strided views of that projection (no copies). fc1 + GELU runs through the
op slot ``SiglipLayer.fc1_gelu`` (`FC1_GELU`): "aten" (default) or "onednn" (CPU, float32 row-major
weight: the GELU fused into the GEMM), picked at load by `flashrt.ops.select`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.ops import Form, Op, OpSlot, register
from flashrt.ops.platform import onednn_available, plain_f32


class SiglipLayer(nn.Module):
    """LayerNorm → multi-head self-attention → residual → LayerNorm → GELU(tanh) MLP → residual."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width, eps=eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=eps)
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)
        self.fc1_gelu = OpSlot(FC1_GELU)  # the reference until `flashrt.ops.select`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(I, N, W) -> (I, N, W). Sub-modules run through ``forward``/``F.linear`` (no module hooks)."""
        i, n, w = x.shape
        qkv = _linear(self.norm1.forward(x), self.qkv).view(i, n, 3, self.num_heads, w // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (I, H, N, D) strided views, no copies
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(i, n, w)
        x = _linear(a, self.o).add_(x)
        return _linear(self.fc1_gelu.run(self.norm2.forward(x), self.fc1), self.fc2).add_(x)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _linear_gelu_onednn(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """CPU, float32, row-major weight: oneDNN GEMM with the tanh-GELU fused (≈ the aten pair within
    float32 rounding; the GELU pass ~4x cheaper)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "gelu", [], "tanh")


def _linear_gelu(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.gelu(_linear(x, layer), approximate="tanh")


FC1_GELU = register(Op("fc1_gelu", _linear_gelu, group="mlp", forms={   # (x, fc1) -> gelu_tanh(fc1(x))
    "onednn": Form(_linear_gelu_onednn, device="cpu", available=onednn_available,
                   fits=lambda layer: plain_f32(layer.fc1.weight))}))


class Siglip(nn.Module):
    """(I, 3, R, R) pixels in [-1, 1] -> (I, N, W) last hidden state (post LayerNorm)."""

    def __init__(self, width: int, depth: int, mlp_dim: int, num_heads: int, patch: int, image_size: int,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros((image_size // patch) ** 2, width))
        self.layers = nn.ModuleList(SiglipLayer(width, mlp_dim, num_heads, eps) for _ in range(depth))
        self.post_norm = nn.LayerNorm(width, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2) + self.pos  # (I, N, W)
        for layer in self.layers:
            x = layer.forward(x)
        return self.post_norm.forward(x)
