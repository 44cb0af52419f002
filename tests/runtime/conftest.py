"""Shared fixtures of the runtime tests: small plain-torch blocks written in the graph style.

The fixtures `make_block` and `make_conv` give factories; each returns (module, buffers, fn, feed):
`buffers` is a dict of static tensors, `fn()` reads the inputs and writes results into the output
and state buffers, `feed(step, gen)` writes new inputs for a step (drawn on the CPU from `gen`,
copied into the buffers on any device). Two instances built from the same seed are identical, so
one can be captured and the other run eagerly.

Shape legend: B batch, T new tokens per step, S cache length, D model width, H heads, E head dim,
C channels, L samples.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, E) at integer positions pos (T,)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, E/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block: attention over a static K/V cache, then an MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, E)

    def forward(self, x, pos, key_valid, k_cache, v_cache):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = rope(self.split(q), pos), rope(self.split(k), pos), self.split(v)
        k_cache.index_copy_(2, pos, k)  # K written at the static positions
        v_cache[:, :, pos] = v  # V by slice assignment (index_put_)
        s = k_cache.shape[2]
        causal = torch.arange(s, device=x.device)[None, :] <= pos[:, None]  # (T, S)
        mask = causal[None, None] & key_valid[:, None, None, :]  # (B, 1, T, S)
        att = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        b, _, t, _ = att.shape
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


def _make_block(seed=0, batch=2, new=4, cache=16, dim=32, heads=4, device="cpu"):
    torch.manual_seed(seed)
    model = Block(dim, heads).eval().to(device)
    e = dim // heads
    buffers = {
        "x": torch.zeros(batch, new, dim),
        "pos": torch.arange(new),
        "key_valid": torch.ones(batch, cache, dtype=torch.bool),
        "k_cache": torch.zeros(batch, heads, cache, e),
        "v_cache": torch.zeros(batch, heads, cache, e),
        "out": torch.zeros(batch, new, dim),
    }
    b = buffers = {name: t.to(device) for name, t in buffers.items()}

    def fn():
        b["out"].copy_(model(b["x"], b["pos"], b["key_valid"], b["k_cache"], b["v_cache"]))

    def feed(step: int, gen: torch.Generator) -> None:
        b["x"].copy_(torch.randn(b["x"].shape, generator=gen))
        b["pos"].copy_(torch.arange(step * new, (step + 1) * new))
        b["key_valid"].fill_(True)
        b["key_valid"][0, 1 : step + 2].fill_(False)  # masked keys on sample 0 (key 0 stays visible)

    return model, buffers, fn, feed


class ConvStack(nn.Module):
    """conv1d -> leaky_relu -> transposed conv1d (x2 upsample) -> residual conv1d."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.pre = nn.Conv1d(channels, channels, 7, padding=3)
        self.up = nn.ConvTranspose1d(channels, channels, 4, stride=2, padding=1)
        self.res = nn.Conv1d(channels, channels, 3, padding=2, dilation=2)
        self.post = nn.Conv1d(channels, 1, 5, padding=2)

    def forward(self, x):
        h = F.leaky_relu(self.pre(x), 0.1)
        h = self.up(h)
        h = h + self.res(F.leaky_relu(h, 0.1))
        return torch.tanh(self.post(h))


def _make_conv(seed=0, batch=1, channels=8, length=24, device="cpu"):
    torch.manual_seed(seed)
    model = ConvStack(channels).eval().to(device)
    buffers = {"mel": torch.zeros(batch, channels, length, device=device),
               "audio": torch.zeros(batch, 1, 2 * length, device=device)}

    def fn():
        torch.tanh(model(buffers["mel"]), out=buffers["audio"])

    def feed(step: int, gen: torch.Generator) -> None:
        buffers["mel"].copy_(torch.randn(buffers["mel"].shape, generator=gen))

    return model, buffers, fn, feed


@pytest.fixture
def make_block():
    """Factory of a transformer block with a static K/V cache (see `_make_block`)."""
    return _make_block


@pytest.fixture
def make_conv():
    """Factory of a conv1d / transposed-conv1d vocoder-like stack (see `_make_conv`)."""
    return _make_conv
