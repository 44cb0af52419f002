"""HiFi-GAN's leaky-ReLU residual blocks (Kong et al. 2020): ResBlock1, ResBlock2 and the multi-receptive-
field fusion `mrf` that averages them. (B, C, T) or rows (B, C, 1, T) -> the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn.conv1d import conv1d
from flashrt.nn.reach import Reach, chain
from flashrt.nn.valid import EXACT

__all__ = ["ResBlock1", "ResBlock2", "mrf"]


class ResBlock1(nn.Module):
    """HiFi-GAN ResBlock1: per dilation d, x += conv2(lrelu(conv1_d(lrelu(x)))). (B, C, T) -> same.

    ``activated`` (optional) is lrelu(x, slope) computed once by a caller that runs several blocks on the
    same x (`mrf`); x and ``activated`` are left unmodified except for their padding halo.
    """

    def __init__(self, channels: int, kernel: int, dilations: Sequence[int], slope: float = 0.1) -> None:
        super().__init__()
        self.slope, self.kernel, self.dilations = slope, kernel, tuple(dilations)
        self.convs1 = nn.ModuleList(conv1d(channels, channels, kernel, d) for d in self.dilations)
        self.convs2 = nn.ModuleList(conv1d(channels, channels, kernel, 1) for _ in self.dilations)

    def forward(self, x: torch.Tensor, valid=EXACT, activated: torch.Tensor | None = None) -> torch.Tensor:
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            a = activated if i == 0 and activated is not None else F.leaky_relu(x, self.slope)
            xt = c1(a, valid, slope=self.slope)                             # conv + leaky_relu
            x = c2(xt, valid, residual=x, into=i > 0)                       # conv + residual; x ours if i > 0
        return x

    def reach(self, rate: int = 1) -> Reach:
        return chain([*self.convs1, *self.convs2], rate)


class ResBlock2(nn.Module):
    """HiFi-GAN ResBlock2: per dilation d, x += conv_d(lrelu(x)). (B, C, T) -> same.

    ``activated``: as in `ResBlock1`.
    """

    def __init__(self, channels: int, kernel: int, dilations: Sequence[int], slope: float = 0.1) -> None:
        super().__init__()
        self.slope, self.kernel, self.dilations = slope, kernel, tuple(dilations)
        self.convs = nn.ModuleList(conv1d(channels, channels, kernel, d) for d in self.dilations)

    def forward(self, x: torch.Tensor, valid=EXACT, activated: torch.Tensor | None = None) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            a = activated if i == 0 and activated is not None else F.leaky_relu(x, self.slope)
            x = conv(a, valid, residual=x, into=i > 0)
        return x

    def reach(self, rate: int = 1) -> Reach:
        return chain(self.convs, rate)


def mrf(blocks: Sequence[nn.Module], x: torch.Tensor, valid=EXACT, **shared: torch.Tensor) -> torch.Tensor:
    """Multi-receptive-field fusion: the mean of parallel residual blocks applied to the same x.

    ``shared`` tensors (e.g. ``activated=lrelu(x)``), computed once by the caller, go to every block.
    """
    out = blocks[0](x, valid, **shared)
    for block in blocks[1:]:
        out.add_(block(x, valid, **shared))
    return out.div_(len(blocks))
