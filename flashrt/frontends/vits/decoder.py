"""The VITS/Piper decoder: `HifiGan` whose multi-receptive-field stages reuse per-thread buffers and whose
last stage runs in cache-sized tiles.

Why (Piper medium, one thread, measured against `HifiGan.forward` on this 2-core AMD EPYC):

* Buffers. At Piper's lengths the stage tensors are megabytes each (the last stage, 32 channels at 256
  steps per frame: 7.8 MB at 240 frames) and HiFi-GAN's MRF makes eight of them per stage (the shared
  activation, each ResBlock2 block's conv output and its activation). Fresh, glibc maps and unmaps them
  (or trims its heap) on every call and the call faults their pages back in: about 25 ms of a 90 ms
  decode at 240 frames (the same call with glibc's trim and mmap thresholds pinned: 65 ms; onnxruntime's
  arena reuses its buffers). Here each stage writes into this thread's scratch buffers
  (`flashrt.nn.spectral_conv._Scratch`, grown to the largest call and kept).
* Tiles. The last stage's 32-channel convs run at ~210-230 GFLOP/s on a few thousand steps and
  ~140-160 on a whole 60k-step sentence, whose tensors no longer fit the caches. So above `TILE_ABOVE`
  frames the last stage's blocks, conv_post and tanh run per tile of `TILE_FRAMES` frames (8,192 steps;
  a last remainder of at most half that in a half tile), each in a window of one of two fixed sizes
  with `VitsDecoder.tail_halo` steps of context on each side (zeros outside the sequence, and past its
  valid end each conv's reach zeroed as `ValidLength` does): two oneDNN plans for every length, no
  per-shape re-planning. Measured (CPU time, third-best of 12 interleaved on a quiet core;
  HifiGan.forward / whole stage in buffers / 16-frame tiles / 32-frame tiles): 72 frames 18.6 / 17.7 /
  19.2 / 19.1 ms, 89 frames 21.8 / 21.7 / 23.3 / 22.5, 128 frames 39.1 / 34.3 / 32.2 / 30.7, 240 frames
  74.4 / 59.3 / 57.8 / 55.9, 600 frames 231 / 186 / 153 / 140. Stage 1 (64 channels, 15k steps at 240
  frames) gained nothing from tiles.
* Upsamplers. oneDNN's transposed conv on a weight packed once (`reset_derived`): torch's dispatch runs
  small calls in its native kernel and reorders the weight every call (first upsampler at 72 frames
  0.78 -> 0.32 ms; level from 240 frames).

Same arithmetic as `HifiGan.forward` (ResBlock2: per block, x + conv_d(lrelu(x)) per dilation, the
blocks' mean); a block's first residual add goes into a copy of x in place (oneDNN's sum post-op), and a
tile's convs start at the tile (oneDNN's blocking may round some sums differently, ~1e-7): stream
windows and the one-shot call agree as before. Only plain eager CPU calls of ResBlock2 decoders take this
path (`_Scratch.active`: a trace, an export or a FLOP counter records `HifiGan.forward` with fresh
tensors). No buffer leaves a call: the audio is fresh.

Shape legend: B batch, C stage channels, T stage steps (frames x the rates so far); rows are
(B, C, 1, T) stored channels-last (`flashrt.nn.audio.to_rows`); W = tile + 2 halo, the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.frontends.vocoders.hifigan import HifiGan
from flashrt.nn.audio import EXACT, to_rows
from flashrt.nn.spectral_conv import _Scratch
from flashrt.nn.valid import ValidLength

_TRANSPOSED = getattr(torch.ops.mkldnn, "_convolution_transpose_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None
_REORDER_T = getattr(torch.ops.mkldnn, "_reorder_convolution_transpose_weight", None) \
    if torch.backends.mkldnn.is_available() else None

__all__ = ["VitsDecoder", "stage_rows", "mrf_stage", "tiles", "TILE_FRAMES", "TILE_ABOVE"]

TILE_FRAMES = 32   # the last stage runs in tiles of this many frames (8,192 steps at hop 256) ...
TILE_ABOVE = 96    # ... when it is longer than this many frames (shorter, its tensors fit the caches)


def stage_rows(scratch: _Scratch, role: str, like: torch.Tensor, steps: int | None = None) -> torch.Tensor:
    """An uninitialised rows tensor shaped as ``like`` (B, C, 1, T) (T = ``steps`` if given), channels-last,
    from ``scratch``."""
    b, c, _, t = like.shape
    t = t if steps is None else steps
    return scratch.take(role, (b, 1, t, c), like).permute(0, 3, 1, 2)


class VitsDecoder(HifiGan):
    """`HifiGan` (same parameters, state dict and reach) whose ResBlock2 stages run in reused buffers in
    plain eager CPU calls. features (B, C, T) -> audio (B, N)."""

    tile_frames = TILE_FRAMES
    tile_above = TILE_ABOVE
    ups_packed: tuple[torch.Tensor | None, ...] = ()

    def reset_derived(self) -> None:
        """The upsamplers' weights reordered once into oneDNN's blocked layout for its transposed conv
        (`load_module` calls this after a load, after the convs' own `reset_derived`)."""
        self.ups_packed = tuple(_pack_transposed(up) for up in self.ups)

    def _upsample(self, i: int, x: torch.Tensor, valid) -> torch.Tensor:
        """ups[i](x): oneDNN's transposed conv on the packed weight where there is one (torch's own
        dispatch runs small calls in its slower native kernel and reorders the weight on every call:
        0.78 -> 0.32 ms for the first upsampler at 72 frames, level from 240), else the module."""
        up = self.ups[i]
        packed = self.ups_packed[i] if i < len(self.ups_packed) else None
        if packed is None or up.polyphase or x.dtype != torch.float32:
            return up(x, valid)
        x = valid.zero(x, up.halo)
        return _TRANSPOSED(x, packed, up.bias, [0, up.padding[0]], [0, 0], [1, up.stride[0]], [1, 1], 1,
                           "none", [], "")

    def forward(self, features: torch.Tensor, valid=EXACT) -> torch.Tensor:
        scratch = _Scratch.active(features)
        if not scratch.keep or features.device.type != "cpu" or self.cfg.resblock != "2" \
                or self.cfg.normalize_before:
            return super().forward(features, valid)
        slope, n, last = self.cfg.leaky_relu_slope, len(self.cfg.resblock_kernel_sizes), len(self.ups) - 1
        x = self.conv_pre(to_rows(features), valid, slope=slope)                 # rows, activated
        for i in range(len(self.ups)):
            x = self._upsample(i, x if i == 0 else F.leaky_relu_(x, slope), valid)  # fresh (B, C, 1, T)
            if i == last and x.shape[-1] > self.tile_above * self.cfg.hop_length:
                return self._tiled_tail(x, valid, scratch)
            x = mrf_stage(self.resblocks[i * n:(i + 1) * n], x, valid, slope, scratch)
        x = self.conv_post(F.leaky_relu_(x, self.cfg.final_slope), valid)        # (B, 1, 1, N), fresh
        return torch.tanh_(x).reshape(x.shape[0], -1)

    def tail_halo(self) -> int:
        """Steps of the last stage a tile's outputs reach on each side: its widest block and conv_post."""
        n = len(self.cfg.resblock_kernel_sizes)
        blocks = self.resblocks[len(self.resblocks) - n:]
        reach = max(sum(c.dilation[0] * (c.kernel_size[0] - 1) // 2 for c in b.convs) for b in blocks)
        return reach + (self.conv_post.kernel_size[0] - 1) // 2

    def _tiled_tail(self, x: torch.Tensor, valid, scratch: _Scratch) -> torch.Tensor:
        """The last stage's blocks, conv_post and tanh over x (B, C, 1, T) in tiles of `tile_frames` hops
        (a last remainder of at most half that in a half tile) with `tail_halo` steps of context each side,
        every tile in a window of one of two fixed sizes (the sequence copied in, zeros outside it), so
        oneDNN plans two shapes for every length. -> (B, N)."""
        n, slope = len(self.cfg.resblock_kernel_sizes), self.cfg.leaky_relu_slope
        blocks = self.resblocks[len(self.resblocks) - n:]
        b, c, _, t = x.shape
        tile, halo = self.tile_frames * self.cfg.hop_length, self.tail_halo()
        end = _valid_end(valid, t)
        audio = x.new_empty(b, t)
        for start, size in tiles(t, tile):
            window = stage_rows(scratch, "vits.window", x, size + 2 * halo)
            lo, hi = start - halo, start + size + halo                           # the window, global steps
            inside = slice(max(lo, 0), min(hi, t))
            window[..., inside.start - lo:inside.stop - lo].copy_(x[..., inside])
            window[..., :inside.start - lo].zero_()
            window[..., inside.stop - lo:].zero_()
            edges = _Edges(max(0, -lo), min(end, hi) - lo, window.shape[-1])
            y = mrf_stage(blocks, window, edges, slope, scratch)
            y = self.conv_post(F.leaky_relu_(y, self.cfg.final_slope), edges)    # (B, 1, 1, W), fresh
            keep = min(size, t - start)
            audio[:, start:start + keep].copy_(torch.tanh_(y[:, 0, 0, halo:halo + keep]))
        return audio


def tiles(steps: int, tile: int) -> list[tuple[int, int]]:
    """(start, size) of the tiles covering ``steps``: whole tiles, the last one a half tile where at most
    half a tile is left (a 112-frame call runs 3.5 tiles of 32 frames, not 4)."""
    out, start = [], 0
    while start < steps:
        size = tile // 2 if steps - start <= tile // 2 else tile
        out.append((start, size))
        start += size
    return out


class _Edges:
    """`ValidLength.zero` for a tile window whose data is steps [lo, hi): each conv's input is zeroed on
    the `halo` steps it reads below lo (before the sequence's start) and from hi (past its valid end)."""

    def __init__(self, lo: int, hi: int, steps: int) -> None:
        self.lo, self.hi, self.steps = lo, max(hi, 0), steps

    def zero(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        reach = self.steps if halo is None else halo
        if self.lo:
            x[..., max(self.lo - reach, 0):self.lo].zero_()
        if self.hi < self.steps:
            x[..., self.hi:self.hi + reach].zero_()
        return x


def _pack_transposed(up: nn.Module) -> torch.Tensor | None:
    """``up``'s weight (Cin, Cout, 1, K) in oneDNN's layout for its transposed conv on rows, or None (not
    a CPU float32 weight, or no oneDNN)."""
    w = up.weight_rows
    if _REORDER_T is None or _TRANSPOSED is None or w.device.type != "cpu" or w.dtype != torch.float32 \
            or not w.numel():
        return None
    return _REORDER_T(w.detach(), [0, up.padding[0]], [0, 0], [1, up.stride[0]], [1, 1], 1,
                      [1, w.shape[0], 1, 64])


def _valid_end(valid, steps: int) -> int:
    """The valid steps of a stage tensor of ``steps`` steps (a host read of a `ValidLength`'s length)."""
    if isinstance(valid, ValidLength):
        return int(valid.length.item()) * (steps // valid.frames)
    return steps


def mrf_stage(blocks: Sequence[nn.Module], x: torch.Tensor, valid, slope: float,
              scratch: _Scratch) -> torch.Tensor:
    """The mean of ResBlock2 ``blocks`` applied to rows x, in ``scratch`` buffers (the returned tensor is
    one: the caller reads it before the next stage). x is left unmodified except for its padding halo."""
    act = torch.ops.aten.leaky_relu.out(x, slope, out=stage_rows(scratch, "vits.act", x))
    out = stage_rows(scratch, "vits.out", x)
    own = stage_rows(scratch, "vits.block", x) if len(blocks) > 1 else None
    tmp = stage_rows(scratch, "vits.lrelu", x)
    for k, block in enumerate(blocks):
        y = out if k == 0 else own
        y.copy_(x)
        for j, conv in enumerate(block.convs):
            a = act if j == 0 else torch.ops.aten.leaky_relu.out(y, slope, out=tmp)
            conv(a, valid, residual=y, into=True)                                # y += conv(a), in place
        if k:
            out.add_(own)
    return out.div_(len(blocks))
