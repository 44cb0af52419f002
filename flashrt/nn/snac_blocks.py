"""SNAC decoder blocks in a channels-last layout: snake, dilated (depthwise) convs, transposed-conv
upsampling as GEMM + overlap-add, residual units, local windowed attention with rotary positions,
position-hashed noise, and the multi-scale code -> latent path.

Shape legend:
    B batch, C channels, T steps at the current rate, L latent frames, N codebook size, d codebook dim,
    H heads, W windows, n window length, e head dim (64), s stride, k kernel taps, R = k / s.

Layout: every activation is (B, T, C) contiguous. On CPU this is what makes SNAC fast (measured on the
24 kHz decoder, 1 thread): the 1x1 convs are prepacked oneDNN GEMMs (`FusedLinear`, residual adds fused
in), the k=7 depthwise convs are one channels-last oneDNN conv (far faster than the (B, C, T) conv),
and a dilation-d conv is the same conv with a (7, 1) kernel over the (T/d, d) "phase" view of the
sequence (oneDNN's dilated depthwise kernels are many times slower: docs/benchmarks/vocoders.md),
the overlap-add of the upsampler adds contiguous rows, and attention needs no transposes.

Checked against the ``snac`` package (hubertsiuzdak/snac) on tiny random configs; differences to it:

- weight norm is folded once at load by the weight map; the modules hold plain weights (conv weights
  in the torch (C_out, C_in/groups, k) layout, 1x1 convs as linear (C_out, C_in), the transposed convs
  as a (k * C_out, C_in) GEMM matrix, snake alphas as (C,));
- the noise blocks take their noise as an argument. `hashed_normal` makes it from a seed and the
  absolute sample position (a counter-based hash, Box-Muller), so it is deterministic, needs no
  generator state, and a stream of chunks sees exactly the noise of the one-shot call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn.convnext import FusedLinear, channels_last, zero_padding_cl, zero_padding_cl_
from flashrt.nn.reach import Reach, chain
from flashrt.nn.valid import EXACT

__all__ = ["ChannelsLastConv", "DecoderBlock", "LocalAttention", "MonoOutputConv", "NoiseBlock",
           "ResidualUnit", "SnacDecoder", "SnacQuantizer", "Snake", "TransposedConv", "convt_weight_to_gemm",
           "hashed_normal"]

HEAD_DIM = 64  # fixed in SNAC's LocalMHA
RESIDUAL_DILATIONS = (1, 3, 9)


class Snake(nn.Module):
    """x + sin(a x)^2 / (a + 1e-9), per channel a.  x (B, T, C); ``alpha`` (C,).

    With a padded ``valid`` the output's padding rows are zeroed in place (snake(0) = 0, so this is the
    zero padding the conv after it needs, at no extra allocation).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.register_buffer("inv_alpha", torch.empty(channels), persistent=False)
        self.reset_derived()

    def reset_derived(self) -> None:
        self.inv_alpha = (self.alpha.detach() + 1e-9).reciprocal()

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        t = x * self.alpha
        t.sin_().square_()
        if t.requires_grad:  # autograd cannot record out=; inference (load_module) never gets here
            return zero_padding_cl(torch.addcmul(x, t, self.inv_alpha), valid)
        torch.addcmul(x, t, self.inv_alpha, out=t)  # in place: a fresh output costs page faults
        return zero_padding_cl_(t, valid)


class ChannelsLastConv(nn.Module):
    """Stride-1 conv with "same" zero padding on (B, T, C_in) -> (B, T, C_out); ``weight`` is torch's
    (C_out, C_in / groups, k).

    Dilation 1: a (1, k) conv2d on the channels-last view (B, C, 1, T). Dilation d > 1: the sequence is
    zero-padded to a multiple of d and viewed as (B, C, T/d, d), i.e. d interleaved phases, and a (k, 1)
    conv2d runs down each phase, which is the dilated conv exactly (same taps, same zero padding).
    """

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1, groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        self.kernel, self.dilation, self.groups = kernel, dilation, groups
        self.pad = (kernel - 1) // 2
        self.weight = nn.Parameter(torch.empty(c_out, c_in // groups, kernel))
        self.bias = nn.Parameter(torch.empty(c_out)) if bias else None

    def reach(self, rate: int = 1) -> Reach:
        return Reach.conv(self.kernel, self.dilation, rate, self.pad * self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = self.dilation
        if d == 1:
            y = F.conv2d(x.transpose(1, 2).unsqueeze(2), self.weight.unsqueeze(2), self.bias,
                         padding=(0, self.pad), groups=self.groups)  # (B, C_out, 1, T) channels-last
            return y.squeeze(2).transpose(1, 2).contiguous()  # no copy when oneDNN kept channels-last
        tp = -(-t // d) * d
        xp = F.pad(x, (0, 0, 0, tp - t)) if tp != t else x
        y = F.conv2d(xp.view(b, tp // d, d, c).permute(0, 3, 1, 2), self.weight.unsqueeze(3), self.bias,
                     padding=(self.pad, 0), groups=self.groups)  # (B, C_out, T/d, d) channels-last
        return y.permute(0, 2, 3, 1).reshape(b, tp, -1)[:, :t].contiguous()


class MonoOutputConv(nn.Module):
    """"Same" conv from C channels to ONE channel: (B, T, C) -> (B, T); ``weight`` (1, C, k).

    P = x @ W^T gives every tap's contribution (B, T, k); y[t] = sum_j P[t + j - pad, j] is one sum over
    a diagonal strided view of the zero-padded P. (oneDNN's conv is several times slower with one output
    channel.)
    """

    def __init__(self, c_in: int, kernel: int = 7) -> None:
        super().__init__()
        self.kernel, self.pad = kernel, (kernel - 1) // 2
        self.weight = nn.Parameter(torch.empty(1, c_in, kernel))
        self.bias = nn.Parameter(torch.empty(1))

    def reach(self, rate: int = 1) -> Reach:
        return Reach.conv(self.kernel, 1, rate, self.pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k = self.kernel
        taps = F.pad(F.linear(x, self.weight[0].t()), (0, 0, self.pad, k - 1 - self.pad))  # (B, T+k-1, k)
        diag = taps.as_strided((b, t, k), (taps.stride(0), k, k + 1))  # diag[t, j] = taps[t + j, j]
        return diag.sum(-1) + self.bias


def convt_weight_to_gemm(weight: torch.Tensor) -> torch.Tensor:
    """ConvTranspose1d weight (C_in, C_out, k) -> the GEMM matrix (k * C_out, C_in) of `TransposedConv`."""
    c_in, c_out, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * c_out, c_in)


class TransposedConv(nn.Module):
    """``ConvTranspose1d(c_in, c_out, k, s, padding, output_padding)`` on (B, T, C_in), k a multiple of s.

    cols = x @ W^T (B, T, k * C_out) is one GEMM; output row t*s + j gets cols[t, r*s + j] for each
    r < R: the first part is written with the bias, the other R - 1 are shifted in-place adds of
    contiguous (T, s, C_out) blocks; then the padding is trimmed (a view, no copy). ``gemm.weight`` is
    (k * C_out, C_in) (`convt_weight_to_gemm`).
    """

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int = 0,
                 output_padding: int = 0) -> None:
        super().__init__()
        if kernel % stride or output_padding > padding:
            raise ValueError(f"TransposedConv: kernel {kernel} must be a multiple of stride {stride} and "
                             f"output_padding {output_padding} <= padding {padding}")
        self.c_out, self.kernel, self.stride = c_out, kernel, stride
        self.padding, self.output_padding = padding, output_padding
        self.gemm = FusedLinear(c_in, kernel * c_out, bias=False)
        self.bias = nn.Parameter(torch.empty(c_out))

    def reach(self, rate: int = 1) -> Reach:
        """Frames an output reaches, for an input at `rate` samples per frame."""
        return Reach.conv_transpose(self.kernel, self.stride, self.padding, rate)

    def output_length(self, t: int) -> int:
        return (t - 1) * self.stride - 2 * self.padding + self.kernel + self.output_padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s, r = self.stride, self.kernel // self.stride
        cols = self.gemm(x).view(b, t, r, s, self.c_out)
        out = x.new_empty(b, t + r - 1, s, self.c_out)
        torch.add(cols[:, :, 0], self.bias, out=out[:, :t])  # every row gets the bias exactly once:
        out[:, t:].copy_(self.bias.expand(b, r - 1, s, -1))   # here, or in the rows only later parts reach
        for i in range(1, r):
            out[:, i:i + t].add_(cols[:, :, i])
        return out.view(b, (t + r - 1) * s, self.c_out)[:, self.padding:self.padding + self.output_length(t)]


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(conv_k7_dilated(snake(x)))) on (B, T, C); same length in and out."""

    def __init__(self, dim: int, dilation: int, groups: int = 1, kernel: int = 7) -> None:
        super().__init__()
        self.snake1 = Snake(dim)
        self.conv1 = ChannelsLastConv(dim, dim, kernel, dilation, groups)
        self.snake2 = Snake(dim)
        self.conv2 = FusedLinear(dim, dim)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        h = self.conv1(self.snake1(x, valid))           # zero padding before the dilated conv
        return self.conv2(self.snake2(h), residual=x)   # 1x1: no reach, no padding to zero

    def reach(self, rate: int = 1) -> Reach:
        return self.conv1.reach(rate)                   # snakes and the 1x1 reach nothing


class NoiseBlock(nn.Module):
    """x + noise * linear(x) (no bias); noise (B, T, 1) or None (noise off: identity)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = FusedLinear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return x if noise is None else torch.addcmul(x, noise.to(x.dtype), self.linear(x))


class DecoderBlock(nn.Module):
    """snake -> upsample x stride -> [noise] -> residual units with dilations 1, 3, 9.
    (B, T, C_in) -> (B, T * stride, C_out)."""

    def __init__(self, c_in: int, c_out: int, stride: int, noise: bool, groups: int = 1) -> None:
        super().__init__()
        self.snake = Snake(c_in)
        self.up = TransposedConv(c_in, c_out, 2 * stride, stride, math.ceil(stride / 2), stride % 2)
        self.noise = NoiseBlock(c_out) if noise else None
        self.res = nn.ModuleList(ResidualUnit(c_out, d, groups) for d in RESIDUAL_DILATIONS)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None, valid=EXACT) -> torch.Tensor:
        x = self.up(self.snake(x, valid))
        if self.noise is not None:
            x = self.noise(x, noise)
        for unit in self.res:
            x = unit(x, valid)
        return x

    def reach(self, rate: int = 1) -> Reach:
        """Frames an output reaches, for an input at `rate` samples per frame."""
        return self.up.reach(rate) + chain(self.res, rate * self.up.stride)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LocalAttention(nn.Module):
    """Pre-norm multi-head attention inside fixed windows of n steps, rotary positions 0..n-1 in each
    window, residual.  x (B, T, C) with T a multiple of n -> (B, T, C).  H = C // 64 heads.

    Windows start at step 0 of the input, so a stream must cut its chunks at window boundaries.
    """

    def __init__(self, dim: int, window: int) -> None:
        super().__init__()
        if dim % HEAD_DIM:
            raise ValueError(f"LocalAttention: dim {dim} is not a multiple of the head size {HEAD_DIM}")
        self.dim, self.window, self.heads = dim, window, dim // HEAD_DIM
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = FusedLinear(dim, 3 * dim, bias=False)
        self.to_out = FusedLinear(dim, dim, bias=False)
        self.register_buffer("cos", torch.empty(window, HEAD_DIM), persistent=False)
        self.register_buffer("sin", torch.empty(window, HEAD_DIM), persistent=False)
        self.reset_derived()

    def reset_derived(self) -> None:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        freqs = torch.arange(self.window, dtype=torch.float32)[:, None] * inv_freq[None, :]
        freqs = torch.cat((freqs, freqs), dim=-1)  # (n, e)
        dtype = self.to_qkv.weight.dtype if self.to_qkv.weight.is_floating_point() else torch.float32
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def _rotary(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * self.cos, _rotate_half(x), self.sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        w = t // self.window
        qkv = self.to_qkv(self.norm(x))  # (B, T, 3C)
        qkv = qkv.view(b, w, self.window, 3, self.heads, HEAD_DIM).permute(3, 0, 4, 1, 2, 5)
        q, k, v = self._rotary(qkv[0]), self._rotary(qkv[1]), qkv[2]  # (B, H, W, n, e)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.permute(0, 2, 3, 1, 4).reshape(b, t, c), residual=x)


class SnacDecoder(nn.Module):
    """Latent (B, L, D_lat) -> audio (B, L * prod(rates)) in [-1, 1].

    Layers: [depthwise k7 + 1x1 | k7] -> [local attention] -> DecoderBlocks (channels halve per block)
    -> snake -> k7 conv to one channel -> tanh. ``noises[i]`` (B, L * prod(rates[:i+1]), 1) feeds
    block i's noise block; ``noises=None`` turns noise off.
    """

    def __init__(self, latent: int, dim: int, rates: Sequence[int], noise: bool, depthwise: bool,
                 window: int | None) -> None:
        super().__init__()
        self.rates = tuple(rates)
        self.pre_dw = ChannelsLastConv(latent, latent, 7, groups=latent) if depthwise else None
        self.pre = FusedLinear(latent, dim) if depthwise else ChannelsLastConv(latent, dim, 7)
        self.attn = LocalAttention(dim, window) if window else None
        widths = [dim // 2 ** i for i in range(len(rates) + 1)]
        self.blocks = nn.ModuleList(
            DecoderBlock(widths[i], widths[i + 1], r, noise, groups=widths[i + 1] if depthwise else 1)
            for i, r in enumerate(rates))
        self.post_snake = Snake(widths[-1])
        self.post = MonoOutputConv(widths[-1], 7)

    def reaches(self, rate: int = 1) -> tuple[Reach, Reach]:
        """(before, after) the attention: the pre convs' reach, and the upsampling blocks' plus the output
        conv's, for a latent input at `rate` samples per frame (attention reaches its whole window)."""
        pre = chain([c for c in (self.pre_dw, self.pre) if isinstance(c, ChannelsLastConv)], rate)
        rest = Reach()
        for block in self.blocks:
            rest = rest + block.reach(rate)
            rate *= block.up.stride
        return pre, rest + self.post.reach(rate)

    def noise_lengths(self, frames: int) -> list[int]:
        """Samples at each block's output for ``frames`` latent frames."""
        return [frames * math.prod(self.rates[:i + 1]) for i in range(len(self.rates))]

    def seeded_noises(self, seed: torch.Tensor, offset: torch.Tensor | int,
                      frames: int) -> list[torch.Tensor]:
        """Position-hashed noise (B, T_i, 1) per block: seed (B,) int64, offset = absolute latent index
        of the first latent frame."""
        return [hashed_normal(seed, i, offset * (n // frames), n)[..., None]
                for i, n in enumerate(self.noise_lengths(frames))]

    def forward(self, z: torch.Tensor, noises: Sequence[torch.Tensor] | None = None,
                valid=EXACT) -> torch.Tensor:
        valid = channels_last(valid)
        z = zero_padding_cl(z, valid)
        x = self.pre(self.pre_dw(z) if self.pre_dw is not None else z)
        if self.attn is not None:
            x = self.attn(x)
        for i, block in enumerate(self.blocks):
            x = block(x, None if noises is None else noises[i], valid)
        return torch.tanh(self.post(self.post_snake(x, valid)))  # (B, N)


class SnacQuantizer(nn.Module):
    """Codes of every scale -> latent: sum over scales of repeat_s(out_proj(codebook[codes])).

    codes[i] (B, L / strides[i]) long -> (B, L, D_lat). Slots per scale i: ``codebooks.{i}`` (N, d),
    ``proj.{i}.weight`` (D_lat, d) and ``proj.{i}.bias`` (weight-norm folded 1x1 conv).
    """

    def __init__(self, latent: int, codebook_size: int, codebook_dim: int, strides: Sequence[int]) -> None:
        super().__init__()
        self.strides = tuple(strides)
        self.codebooks = nn.ParameterList(torch.empty(codebook_size, codebook_dim) for _ in strides)
        self.proj = nn.ModuleList(nn.Linear(codebook_dim, latent) for _ in strides)

    def forward(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        z = None
        for book, proj, stride, c in zip(self.codebooks, self.proj, self.strides, codes):
            y = proj(F.embedding(c, book))  # (B, T_i, D_lat)
            b, t, d = y.shape
            y = y[:, :, None].expand(b, t, stride, d).reshape(b, t * stride, d)
            z = y if z is None else z + y
        return z


# ------------------------------------------------------------------------------- position-hashed noise

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 in int64 without overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xor-shift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """Top 24 bits of a 32-bit hash -> float32 in (0, 1), exactly representable."""
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def hashed_normal(seed: torch.Tensor, stream: int, start: torch.Tensor | int, length: int) -> torch.Tensor:
    """Standard normal noise (B, length) that depends only on (seed, stream, absolute position).

    seed (B,) int64 (taken mod 2^32); stream: which noise source (decoder block index); start: absolute
    position of the first sample (int or 0-d int64 tensor, so it can live in a static buffer).
    """
    key = _mix32((seed.to(torch.int64) & _MASK32) ^ _mul32(torch.full_like(seed, stream + 1), 0x9E3779B9))
    pos = (torch.arange(length, device=seed.device, dtype=torch.int64) + start) & _MASK32
    h = _mix32(key[:, None] ^ _mix32(pos)[None, :])  # (B, length)
    u1, u2 = _uniform(_mix32(h ^ 0x68E31DA4)), _uniform(_mix32(h ^ 0x1B56C4E9))
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
