"""3-tap convs as Winograd F(4, 3) on CPU: native transforms around one oneDNN grouped GEMM.

Shape legend: B batch, C input channels, O output channels, T time steps, d dilation, S = ceil(T / d)
steps per dilation phase, tiles = ceil(S / 4).

Why: HiFi-GAN's kernel-3 resblock convs (a seventh of its taps, a fifth of a short call's time on the
dev CPU) are too short for the block-spectral form (`flashrt.nn.spectral_conv`: its transforms are not
paid back at 3 taps). Winograd's minimal filtering computes 4 outputs of a 3-tap conv from 6 products
instead of 12: the transforms (csrc/winograd_cpu.c, one pass each, vectorized over channels) take the
6 inputs of each tile to 6 transformed rows and the 6 products back to 4 outputs; the products are one
oneDNN grouped 1x1 conv over the tiles (6 groups of C -> O, weight packed once), as the spectral
products are. Dilated convs run each phase as its own sequence (the (T/d, d) view, phases side by
side). Alone it beats oneDNN's direct conv at 64-256 channels (not at 32, whose 64-wide products
oneDNN runs slowly); inside V1 (cold caches: the products' weight is twice the conv's, the transformed
rows 1.5x its input) it gains at 128 and 256 channels and loses at 64 on long calls. So `WIDTHS` is 128
and 256 channels (timings in docs/benchmarks/vocoders.md, "Measurements behind the code").
Error: 2-8x the direct conv's against float64 (~6e-6 vs ~2e-6 on unit-scale inputs; A's and B's
entries reach 8 and 5), far inside the vocoders' 1e-4 gates. Memory: the packed products, 6 C O floats
per conv (HiFi-GAN V1's 12: ~12 MB).

Runs only in plain eager calls on CPU float32 rows where the CPU library loads and oneDNN's packed
grouped conv is the AVX-512 one (`flashrt.nn.spectral_conv.grouped_products`); anything else (a
recording mode, export, another dtype) runs the owner's direct conv (`engages`). The tiles start at
the call's first step, so a stream's windows round like the one-shot call only to ~1e-7 (as with the
spectral convs: the ``invariant`` conv policy leaves 3-tap convs direct).
"""

from __future__ import annotations

import torch
from torch import nn

from flashrt.nn.spectral_conv import _CONV, _REORDER, _Scratch, grouped_products

__all__ = ["WIDTHS", "WinogradPlan", "winograd_eligible"]

WIDTHS = (128, 256)   # channel counts (in and out) measured faster than oneDNN's direct conv in V1
_G = ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
      (1 / 24, -1 / 12, 1 / 6), (0, 0, 1))   # U_j = sum_k G[j][k] W_k (csrc/winograd_cpu.c)


def winograd_eligible(conv: nn.Module) -> bool:
    """A stride-1, ungrouped, 3-tap, 'same'-padded float32 CPU conv at `WIDTHS` channels."""
    out_ch, in_ch, taps = conv.weight.shape
    return (taps == 3 and conv.stride[0] == 1 and conv.groups == 1 and conv.padding[0] == conv.dilation[0]
            and in_ch in WIDTHS and out_ch in WIDTHS and conv.weight.dtype == torch.float32
            and conv.weight.device.type == "cpu")


class WinogradPlan(nn.Module):
    """One 3-tap conv's F(4, 3) form (derived from its weight; rebuilt when the weight changes).

    weight (O, C, 3) float32 on the CPU, ``dilation`` d ('same' padding d), ``bias`` (O,) or None.
    ``halo``: in a padded call, the steps past the valid end a valid output's rounding depends on (its
    tile's 6 inputs, up to 6 d steps past the end: the transforms mix them all); the owner zeroes them
    first (as `flashrt.nn.spectral_conv.SpectralPlan.halo`).
    """

    def __init__(self, weight: torch.Tensor, dilation: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        out_ch, in_ch, taps = weight.shape
        if taps != 3:
            raise ValueError(f"Winograd F(4, 3) takes 3-tap convs, not {taps}")
        self.dilation, self.out_ch, self.in_ch = dilation, out_ch, in_ch
        self.halo = 6 * dilation   # a tile's span, in steps
        g = torch.tensor(_G, dtype=torch.float64)
        products = torch.einsum("jk,ock->joc", g, weight.detach().double())          # (6, O, C)
        products = products.reshape(6 * out_ch, in_ch, 1, 1).float().contiguous()
        self.packed = _REORDER(products, [0, 0], [1, 1], [1, 1], 6, [1, 6 * in_ch, 64, 1]) \
            if grouped_products() else None
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(),
                             persistent=False)

    def engages(self, x: torch.Tensor) -> bool:
        """A plain eager call on CPU float32 rows, where the CPU library and oneDNN's grouped conv are."""
        return (self.packed is not None and x.dim() == 4 and x.device.type == "cpu"
                and x.dtype == torch.float32 and _Scratch.active(x).keep and _kernels() is not None)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x rows (B, C, 1, T) -> rows (B, O, 1, T) channels-last (conv + bias)."""
        kernels, scratch = _kernels(), _Scratch.active(x)
        rows = [self._one(x[i], kernels, scratch) for i in range(x.shape[0])]
        out = rows[0] if len(rows) == 1 else torch.stack(rows)
        return out.view(x.shape[0], -1, self.out_ch).permute(0, 2, 1).unsqueeze(2)

    def _one(self, x: torch.Tensor, kernels: tuple, scratch: _Scratch) -> torch.Tensor:
        """One sequence, rows (C, 1, T) channels-last -> (T, O); the transform reads x in place (steps
        past T are zeros to it)."""
        forward, backward = kernels
        c, _, t = x.shape
        d = self.dilation
        steps = -(-t // d)
        seq = x.permute(1, 2, 0).reshape(t, c).contiguous()                         # (T, C), no copy on rows
        tiles = -(-steps // 4)
        v = scratch.take("winograd", (tiles * d, 6 * c), x)                         # (tiles, D, 6, C)
        _check(forward(seq.data_ptr(), v.data_ptr(), t, steps, d, c))
        image = v.view(1, tiles * d, 1, 6 * c).permute(0, 3, 1, 2)
        m = _CONV(image, self.packed, None, [0, 0], [1, 1], [1, 1], 6, "none", [], "")
        y = x.new_empty(steps * d, self.out_ch)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        _check(backward(m.data_ptr(), y.data_ptr(), steps, d, self.out_ch, bias))
        return y[:t]


def _check(status: int) -> None:
    if status:
        raise RuntimeError(f"a Winograd transform refused its arguments (status {status})")


def _kernels():
    """(flashrt_wino43_in, flashrt_wino43_out) of the CPU library, or None where it does not load."""
    from flashrt.ops import csrc_cpu

    lib = csrc_cpu.load()
    return None if lib is None else (lib.handle.flashrt_wino43_in, lib.handle.flashrt_wino43_out)
