"""The VITS/Piper decoder: `HifiGan` whose multi-receptive-field stages reuse per-thread buffers.

Why: at Piper's lengths the decoder's stage tensors are megabytes each (the last stage, 32 channels at
256 samples per frame: 7.8 MB at 240 frames), and HiFi-GAN's MRF makes eight of them per stage (the
shared activation, each ResBlock2 block's conv output and its activation). Fresh, glibc maps and unmaps
them (or trims its heap) on every call and the call faults their pages back in: measured 25 ms of a
90 ms decode at 240 frames, one thread (the same call with glibc's trim and mmap thresholds pinned:
65 ms). onnxruntime's arena reuses its buffers; here each stage writes into this thread's scratch
buffers (`flashrt.nn.spectral_conv._Scratch`, grown to the largest call and kept), so the only fresh
tensors of a call are the upsamplers' outputs and the audio.

Same arithmetic as `HifiGan.forward` (ResBlock2: per block, x + conv_d(lrelu(x)) per dilation, the
blocks' mean), except that the block's first residual add goes into a copy of x in place (oneDNN's
sum post-op) instead of into a fresh output (the binary add post-op): both add the same two fp32 values.
Only plain eager CPU calls of ResBlock2 decoders reuse buffers (`_Scratch.active`: a trace, an export or
a FLOP counter records fresh tensors, via `HifiGan.forward`), and no buffer leaves the call: every
stage's output is read by the next upsampler or by conv_post, whose outputs are fresh.

Shape legend: B batch, C stage channels, T stage steps (frames x the rates so far); rows are
(B, C, 1, T) stored channels-last (`flashrt.nn.audio.to_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.frontends.vocoders.hifigan import HifiGan
from flashrt.nn.audio import EXACT, to_rows
from flashrt.nn.spectral_conv import _Scratch

__all__ = ["VitsDecoder", "stage_rows"]


def stage_rows(scratch: _Scratch, role: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised rows tensor shaped as ``like`` (B, C, 1, T), channels-last, from ``scratch``."""
    b, c, _, t = like.shape
    return scratch.take(role, (b, 1, t, c), like).permute(0, 3, 1, 2)


class VitsDecoder(HifiGan):
    """`HifiGan` (same parameters, state dict and reach) whose ResBlock2 stages run in reused buffers in
    plain eager CPU calls. features (B, C, T) -> audio (B, N)."""

    def forward(self, features: torch.Tensor, valid=EXACT) -> torch.Tensor:
        scratch = _Scratch.active(features)
        if not scratch.keep or features.device.type != "cpu" or self.cfg.resblock != "2" \
                or self.cfg.normalize_before:
            return super().forward(features, valid)
        slope, n = self.cfg.leaky_relu_slope, len(self.cfg.resblock_kernel_sizes)
        x = self.conv_pre(to_rows(features), valid, slope=slope)                 # rows, activated
        for i, up in enumerate(self.ups):
            x = up(x if i == 0 else F.leaky_relu_(x, slope), valid)             # fresh rows (B, C, 1, T)
            x = mrf_stage(self.resblocks[i * n:(i + 1) * n], x, valid, slope, scratch)
        x = self.conv_post(F.leaky_relu_(x, self.cfg.final_slope), valid)        # (B, 1, 1, N), fresh
        return torch.tanh_(x).reshape(x.shape[0], -1)


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
