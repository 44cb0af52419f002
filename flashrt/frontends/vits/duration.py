"""The VITS stochastic duration predictor (reverse) time-major: the CPU form of
`StochasticDurationPredictor`.

Same math as `flashrt.frontends.vits.modules.StochasticDurationPredictor.forward`, rearranged once at
load, as the text encoder's CPU form (`flashrt.frontends.vits.encoder`):

* time-major (P, H) state: the DDSConv LayerNorms and GELUs run on the last axis of contiguous tensors
  (the conv form normalized a transposed view and ran the GELUs on its strided result); the depthwise
  dilated convs run on the channels-last view (oneDNN's depthwise conv, no copies);
* the 1x1 convs are packed GEMMs (`flashrt.nn.packed_linear`);
* the Flips between the spline couplings are folded into which of the two noise rows each coupling
  reads and writes;
* the spline's parameters come out of the proj GEMM already laid out (P, 3K - 1), as the spline wants.

Shape legend: P phonemes (the bucket), H hidden channels, K spline bins.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashrt.nn.packed_linear import PackedLinear

__all__ = ["PackedDurationPredictor"]


def _linear(conv: torch.nn.Conv1d) -> PackedLinear:
    return PackedLinear(conv.weight.detach()[:, :, 0], conv.bias.detach())


def _norm(norm) -> tuple:
    return norm.gamma.detach(), norm.beta.detach(), norm.eps


class _DDSConv:
    """`DDSConv` on (P, H): depthwise dilated conv, LayerNorm, GELU, 1x1, LayerNorm, GELU, residual."""

    def __init__(self, dds) -> None:
        self.seps = [(c.weight.detach().unsqueeze(2), c.bias.detach(), c.padding[0], c.dilation[0], c.groups)
                     for c in dds.convs_sep]
        self.pws = [_linear(c) for c in dds.convs_1x1]
        self.n1s, self.n2s = [_norm(n) for n in dds.norms_1], [_norm(n) for n in dds.norms_2]

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        if g is not None:
            x = x + g
        h = x.shape[1]
        for (w, b, pad, dil, groups), pw, n1, n2 in zip(self.seps, self.pws, self.n1s, self.n2s):
            rows = (x * mask).t()[None, :, None]  # (1, H, 1, P) channels-last view
            y = F.conv2d(rows, w, b, padding=(0, pad), dilation=(1, dil), groups=groups)[0, :, 0].t()
            y = F.gelu(F.layer_norm(y, (h,), *n1))
            x = x + F.gelu(F.layer_norm(pw(y), (h,), *n2))
        return x * mask


class _SplineFlow:
    """One `ConvFlow` (reverse), told whether the two rows it sees are swapped (the Flips before it)."""

    def __init__(self, flow, swapped: bool) -> None:
        self.swapped, self.bins, self.bound = swapped, flow.bins, flow.bound
        self.scale = math.sqrt(flow.filters)
        self.pre, self.proj, self.convs = _linear(flow.pre), _linear(flow.proj), _DDSConv(flow.convs)

    def __call__(self, z: list[torch.Tensor], mask: torch.Tensor, cond: torch.Tensor) -> None:
        from flashrt.frontends.vits.modules import spline_inverse

        src, dst = (1, 0) if self.swapped else (0, 1)
        h = self.proj(self.convs(self.pre(z[src]), mask, g=cond)).mul_(mask)  # (P, 3K - 1)
        k = self.bins
        x1 = spline_inverse(z[dst][:, 0], h[:, :k] / self.scale, h[:, k : 2 * k] / self.scale, h[:, 2 * k :],
                            self.bound)
        z[dst] = x1[:, None] * mask
        z[src] = z[src] * mask


class PackedDurationPredictor:
    """`StochasticDurationPredictor.forward` time-major (module docstring); derived from its weights at
    `StochasticDurationPredictor.pack` (rebuild after changing them)."""

    def __init__(self, sdp) -> None:
        from flashrt.frontends.vits.modules import ConvFlow, Flip

        self.pre, self.proj, self.convs = _linear(sdp.pre), _linear(sdp.proj), _DDSConv(sdp.convs)
        self.cond = getattr(sdp, "cond", None)
        affine = sdp.flows[0]
        self.shift, self.inv_scale = affine.m.detach()[:, 0], affine.inv_scale.detach()[:, 0]  # (2,)
        self.flows, swapped = [], False
        for module in reversed(sdp.flows[2:]):
            if isinstance(module, Flip):
                swapped = not swapped
            elif isinstance(module, ConvFlow):
                self.flows.append(_SplineFlow(module, swapped))
        self.swapped_out = swapped

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor,
                 g: torch.Tensor | None = None) -> torch.Tensor:
        """x (1, H, P), mask (1, 1, P), noise (1, 2, P), g (1, G, 1) or None -> log durations (1, 1, P)."""
        mask_t = mask[0].t()  # (P, 1)
        h = self.pre(x[0].t().contiguous())
        if g is not None:
            h = h + self.cond(g).view(1, -1)
        cond = self.proj(self.convs(h, mask_t)).mul_(mask_t)  # (P, H)
        rows = noise[0].t()  # (P, 2)
        z = [rows[:, :1].contiguous(), rows[:, 1:].contiguous()]
        for flow in self.flows:
            flow(z, mask_t, cond)
        first = z[1] if self.swapped_out else z[0]  # the channel the affine's row 0 sees
        out = (first - self.shift[0]) * self.inv_scale[0] * mask_t
        return out.t().unsqueeze(0)
