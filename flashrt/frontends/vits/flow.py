"""The VITS coupling flow (reverse) time-major on packed GEMMs: the CPU form of `CouplingFlow`.

Same math as `flashrt.frontends.vits.modules.CouplingFlow.forward`, rearranged once at load:

* time-major: the latent is held as two (F, C/2) halves, every conv is a GEMM over time steps: a WN
  layer's k-tap dilated conv reads its k shifted windows side by side (one (F, k H) copy out of a
  zero-margined (F + 2 pad, H) buffer) against the weight laid out (2H, k H); 1x1 convs are plain GEMMs;
* packed weights with fused epilogues (`flashrt.nn.packed_linear`): the in-layer conv is two GEMMs, the
  tanh half and the sigmoid half with their activations in the epilogue (the gate is one multiply after
  them); the res/skip 1x1 conv is two GEMMs whose epilogues add the residual and the running skip sum;
  the coupling's post conv is packed negated, its epilogue adding x1, so x1 - post(...) is one call;
* the Flips are folded into the weights: a coupling that sees the channels reversed reads the other
  half through its pre conv's columns reversed and writes it through its post conv's rows reversed;
* the masks a 1x1 conv makes redundant are dropped (post(out * mask) * mask = post(out) * mask row by
  row); the ones that keep padded steps zero before a k-tap conv stay.

On the dev CPU this is 1.5-2.5x the conv1d form (docs/benchmarks/tts.md). Float32 results differ from
it by GEMM rounding only (tests/frontends/vits: the voice stays within 1e-4 of onnxruntime).

Shape legend: F frames (the bucket), C latent channels, H hidden channels, k taps, G speaker width.
"""

from __future__ import annotations

import torch

from flashrt.nn.packed_linear import PackedLinear

__all__ = ["PackedFlow"]


def _weight_2d(conv: torch.nn.Conv1d) -> torch.Tensor:
    """A 1x1 conv's weight (O, I, 1) as (O, I)."""
    return conv.weight.detach()[:, :, 0]


class _Layer:
    """One WN layer: the gate's two halves, the residual and skip GEMMs, the tap offsets into the
    padded buffer, and its slice of the speaker conditioning."""

    def __init__(self, inp: torch.nn.Conv1d, res_skip: torch.nn.Conv1d, hidden: int, margin: int,
                 last: bool) -> None:
        k, d = inp.kernel_size[0], inp.dilation[0]
        start = margin - inp.padding[0]
        self.offsets = [start + j * d for j in range(k)]
        w = inp.weight.detach().permute(0, 2, 1).reshape(2 * hidden, k * hidden)  # (2H, k H), tap-major
        b = inp.bias.detach()
        self.bias_t, self.bias_s = b[:hidden], b[hidden:]
        self.tanh = PackedLinear(w[:hidden], self.bias_t, "tanh")
        self.sigmoid = PackedLinear(w[hidden:], self.bias_s, "sigmoid")
        rs, rb = _weight_2d(res_skip), res_skip.bias.detach()
        self.res = None if last else PackedLinear(rs[:hidden], rb[:hidden])
        self.skip = PackedLinear(rs if last else rs[hidden:], rb if last else rb[hidden:])


class _Coupling:
    """One ResidualCoupling, told whether the channels it sees are reversed (the Flips before it)."""

    def __init__(self, coupling: torch.nn.Module, flipped: bool) -> None:
        enc = coupling.enc
        self.hidden = enc.channels
        self.margin = max(conv.padding[0] for conv in enc.in_layers)
        self.flipped = flipped
        pre_w, post_w = _weight_2d(coupling.pre), _weight_2d(coupling.post)
        post_b = coupling.post.bias.detach()
        if flipped:  # x0 = flip(second half): pre's columns reversed; x1 = flip(first half): post's rows
            pre_w, post_w, post_b = pre_w.flip(1), post_w.flip(0), post_b.flip(0)
        self.pre = PackedLinear(pre_w, coupling.pre.bias.detach())
        self.post = PackedLinear(-post_w, -post_b)  # its epilogue adds x1: x1 - post(out)
        layers = len(enc.in_layers)
        self.layers = [
            _Layer(inp, rs, self.hidden, self.margin, i == layers - 1)
            for i, (inp, rs) in enumerate(zip(enc.in_layers, enc.res_skip_layers))
        ]
        self.cond = getattr(enc, "cond_layer", None)

    def __call__(self, halves: list[torch.Tensor], mask: torch.Tensor, g: torch.Tensor | None) -> None:
        """Updates the half it transforms in place of the list."""
        src, dst = (1, 0) if self.flipped else (0, 1)
        frames, h, m = mask.shape[0], self.hidden, self.margin
        padded = halves[src].new_zeros(frames + 2 * m, h)
        x = padded[m : m + frames]
        torch.mul(self.pre(halves[src]), mask, out=x)
        cond = None if g is None or self.cond is None else self.cond(g).view(-1)  # (2H * layers,)
        skip = None
        for i, layer in enumerate(self.layers):
            cols = torch.cat([padded[o : o + frames] for o in layer.offsets], dim=1)  # (F, k H)
            bt = bs = None
            if cond is not None:  # the speaker's per-channel constant folded into the gate's biases
                c = cond[2 * h * i : 2 * h * (i + 1)]
                bt, bs = layer.bias_t + c[:h], layer.bias_s + c[h:]
            acts = layer.tanh(cols, bias=bt).mul_(layer.sigmoid(cols, bias=bs))
            skip = layer.skip(acts) if skip is None else layer.skip(acts, other=skip)
            if layer.res is not None:
                torch.mul(layer.res(acts, other=x), mask, out=x)
        halves[dst] = self.post(skip, other=halves[dst]).mul_(mask)


class PackedFlow:
    """`CouplingFlow.forward` time-major on packed GEMMs (module docstring); derived from the flow's
    weights at `CouplingFlow.pack` (rebuild after changing them)."""

    def __init__(self, flow: torch.nn.Module) -> None:
        from flashrt.frontends.vits.modules import Flip

        self.couplings, flipped = [], False
        for module in reversed(flow.flows):
            if isinstance(module, Flip):
                flipped = not flipped
            else:
                self.couplings.append(_Coupling(module, flipped))
        self.flipped_out = flipped  # an odd number of Flips leaves the channels reversed

    def __call__(self, z: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """z (1, C, F), mask (1, 1, F), g (1, G, 1) or None -> (1, C, F)."""
        zt = z[0].t()  # (F, C) view
        half = zt.shape[1] // 2
        halves = [zt[:, :half].contiguous(), zt[:, half:].contiguous()]
        mask_t = mask[0].t()  # (F, 1)
        for coupling in self.couplings:
            coupling(halves, mask_t, g)
        out = torch.cat(halves, dim=1)
        if self.flipped_out:
            out = out.flip(1)
        return out.t().unsqueeze(0)
