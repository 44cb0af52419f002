"""Qwen3-VL blocks (the GR00T N1.7 backbone): vision tower with deepstack mergers, Qwen3 text layers, M-RoPE.

Shapes: I images, 3 channels, R x Q image side (multiples of 2P), P patch side, g = (R/P) * (Q/P) patches
per image, m spatial merge side (2), n = g / m² merged tokens per image, C vision width, O output width
(= text width W), L tokens, H query heads, KV key/value heads, D head_dim.

Differences from transformers' Qwen3-VL, all exact re-arrangements for the fixed image grids used here:

* A still image is fed as two identical frames (temporal patch 2). The 3-D patch convolution over two
  equal frames equals a 2-D convolution with the temporal kernel summed: `VisionTower` keeps the
  checkpoint's Conv3d weight and derives ``patch_w2d`` (`reset_derived`), so the images go in as
  (I, 3, R, Q) pixels, not as flattened patches.
* Patch tokens are ordered as the reference orders them (merge windows of m x m patches, row-major,
  patches row-major inside a window); the interpolated position embeddings and the 2-D rotary tables
  depend only on the grid, so `VisionTower.tables(gh, gw)` computes them once per grid (load time).
* Images attend only to themselves (the reference's ``cu_seqlens``): one batched SDPA over I.
* Text: M-RoPE tables for a fixed token layout come from `mrope_cos_sin(positions (3, L))`; the
  interleaved frequency assignment (T H W T H W ... T) is applied to positions, not to frequencies.
  The text layers are the one decoder layer (`qwen3_layer`: `flashrt.nn.llama.DecoderLayer` with q/k
  norms, run without a cache: `DecoderLayer.causal`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.nn.llama import DecoderLayer, LayerShape
from flashrt.nn.rope import apply_rope


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class VisionBlock(nn.Module):
    """LayerNorm → attention (2-D RoPE, fused qkv with bias) → residual → LayerNorm → tanh-GELU MLP."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (I, g, C); cos/sin (1, g, 1, D) -> (I, g, C)."""
        i, g, c = x.shape
        qkv = _linear(self.norm1.forward(x), self.qkv).view(i, g, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.unbind(2)  # (I, g, H, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = _linear(a.transpose(1, 2).reshape(i, g, c), self.proj).add_(x)
        h = F.gelu(_linear(self.norm2.forward(x), self.fc1), approximate="tanh")
        return _linear(h, self.fc2).add_(x)


class PatchMerger(nn.Module):
    """m² neighbouring patches → one token: LayerNorm (before or after the merge) → Linear → GELU → Linear."""

    def __init__(self, width: int, out_width: int, merge: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = width * merge * merge
        self.postshuffle = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else width, eps=1e-6)
        self.fc1 = nn.Linear(self.merged, self.merged)
        self.fc2 = nn.Linear(self.merged, out_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(I, g, C) -> (I, n, O)."""
        i = x.shape[0]
        x = (
            self.norm.forward(x.reshape(i, -1, self.merged))
            if self.postshuffle
            else self.norm.forward(x).reshape(i, -1, self.merged)
        )
        return _linear(F.gelu(_linear(x, self.fc1)), self.fc2)


class VisionTower(nn.Module):
    """(I, 3, R, Q) normalized pixels -> merged tokens (I, n, O) and one (I, n, O) per deepstack layer."""

    def __init__(
        self,
        width: int,
        depth: int,
        mlp_dim: int,
        num_heads: int,
        patch: int,
        temporal: int,
        merge: int,
        num_pos: int,
        out_width: int,
        deepstack: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.width, self.patch, self.merge, self.num_heads = width, patch, merge, num_heads
        self.grid_side = int(round(num_pos**0.5))
        self.patch_proj = nn.Conv3d(3, width, (temporal, patch, patch), (temporal, patch, patch))
        self.pos_embed = nn.Embedding(num_pos, width)
        self.blocks = nn.ModuleList(VisionBlock(width, mlp_dim, num_heads) for _ in range(depth))
        self.merger = PatchMerger(width, out_width, merge, postshuffle_norm=False)
        self.deepstack = tuple(deepstack)
        self.deepstack_mergers = nn.ModuleList(PatchMerger(width, out_width, merge, True) for _ in deepstack)
        self.register_buffer("patch_w2d", torch.empty(width, 3, patch, patch), persistent=False)

    def reset_derived(self) -> None:
        self.patch_w2d = self.patch_proj.weight.sum(2)

    def tables(self, gh: int, gw: int) -> dict[str, torch.Tensor]:
        """Position embeddings (g, C) and rotary tables (1, g, 1, D) of a gh x gw patch grid, token order."""
        return {"pos": self._interpolated_pos(gh, gw), **self._rotary(gh, gw)}

    def _window_order(self, t: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """(gh*gw, ...) row-major patches -> merge-window order."""
        m = self.merge
        rest = t.shape[1:]
        t = t.reshape(gh // m, m, gw // m, m, *rest).transpose(1, 2)
        return t.reshape(gh * gw, *rest)

    def _interpolated_pos(self, gh: int, gw: int) -> torch.Tensor:
        """Bilinear interpolation of the learned side x side grid, the reference's float32 arithmetic."""
        n = self.grid_side
        hs, ws = torch.linspace(0, n - 1, gh), torch.linspace(0, n - 1, gw)
        h0, w0 = hs.int(), ws.int()
        h1, w1 = (h0 + 1).clip(max=n - 1), (w0 + 1).clip(max=n - 1)
        dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
        corners = (
            (h0[:, None] * n + w0[None], (1 - dh) * (1 - dw)),
            (h0[:, None] * n + w1[None], (1 - dh) * dw),
            (h1[:, None] * n + w0[None], dh * (1 - dw)),
            (h1[:, None] * n + w1[None], dh * dw),
        )
        w = self.pos_embed.weight
        out = None
        for idx, weight in corners:
            term = w[idx.flatten().to(w.device)] * weight.flatten().to(w)[:, None]
            out = term if out is None else out + term
        return self._window_order(out, gh, gw)

    def _rotary(self, gh: int, gw: int) -> dict[str, torch.Tensor]:
        dim = self.width // self.num_heads // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        rows = torch.arange(gh)[:, None].expand(gh, gw).reshape(-1)
        cols = torch.arange(gw)[None, :].expand(gh, gw).reshape(-1)
        rc = self._window_order(torch.stack([rows, cols], -1), gh, gw).float()
        ang = torch.cat([rc[:, :1] * inv, rc[:, 1:] * inv], -1)  # (g, D/2)
        cos, sin = ang.cos(), ang.sin()
        dev = self.pos_embed.weight.device
        return {
            "cos": torch.cat([cos, cos], -1)[None, :, None].to(dev),
            "sin": torch.cat([-sin, sin], -1)[None, :, None].to(dev),
        }

    def forward(self, pixels: torch.Tensor, tables: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
        i, m = pixels.shape[0], self.merge
        x = F.conv2d(pixels.to(self.patch_w2d.dtype), self.patch_w2d, self.patch_proj.bias, stride=self.patch)
        _, c, gh, gw = x.shape  # (I, C, gh, gw) -> merge-window token order (I, g, C)
        x = x.view(i, c, gh // m, m, gw // m, m).permute(0, 2, 4, 3, 5, 1).reshape(i, gh * gw, c)
        x = x + tables["pos"].to(x.dtype)
        cos, sin = tables["cos"].to(x.dtype), tables["sin"].to(x.dtype)
        deep = []
        for idx, block in enumerate(self.blocks):
            x = block.forward(x, cos, sin)
            if idx in self.deepstack:
                deep.append(self.deepstack_mergers[self.deepstack.index(idx)].forward(x))
        return self.merger.forward(x), deep


def qwen3_layer(width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                eps: float = 1e-6) -> DecoderLayer:
    """The Qwen3 text layer (RMSNorm → GQA attention with per-head q/k RMSNorm and M-RoPE → RMSNorm →
    SwiGLU) as the one decoder layer, `flashrt.nn.llama.DecoderLayer`: fused ``qkv`` and ``gate_up``
    projections (the weight map concatenates), norms with the float32 product (``cast_first`` off, as
    GR00T computes them); run with ``forward(x, (cos, sin))`` (`DecoderLayer.causal`)."""
    return DecoderLayer(LayerShape(width, mlp_dim, num_heads, num_kv_heads, head_dim, eps, qk_norm=True,
                                 cast_first=False))


def mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    section: tuple[int, int, int],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved M-RoPE tables (1, L, 1, D) for ``positions`` (3, L) (temporal, height, width rows).

    Frequency i uses the height row when ``i % 3 == 1 and i < 3 * section[1]``, the width row when
    ``i % 3 == 2 and i < 3 * section[2]``, else the temporal row (transformers' interleaved layout)."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    axis = torch.zeros(half, dtype=torch.long)
    idx = torch.arange(half)
    axis[(idx % 3 == 1) & (idx < 3 * section[1])] = 1
    axis[(idx % 3 == 2) & (idx < 3 * section[2])] = 2
    pos = positions.float()[axis]  # (D/2, L)
    ang = (pos * inv[:, None]).T  # (L, D/2)
    cos, sin = ang.cos(), ang.sin()
    return (
        torch.cat([cos, cos], -1)[None, :, None].to(dtype),
        torch.cat([-sin, sin], -1)[None, :, None].to(dtype),
    )
