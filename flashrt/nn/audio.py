"""Shared audio blocks for the vocoder families (HiFi-GAN, BigVGAN, Vocos, SNAC).

Shape legend:
    B  batch
    C  channels
    T  time steps at the block's own rate (frames x the upsampling done so far)
    K  kernel taps

Conventions every block here follows:

* Weight norm is never a module parametrization. Checkpoints store it three ways (plain ``weight``;
  legacy ``weight_g``/``weight_v``; ``parametrizations.weight.original0/1``); `conv_rules` maps all
  three declaratively and folds g, v once at load (`flashrt.io.transforms.weight_norm`). Modules hold
  plain ``weight``/``bias``.
* Layout. Every block takes (B, C, T) or "rows": (B, C, 1, T) stored channels-last (`to_rows`), the
  layout in which oneDNN runs these 1-D convs fastest on CPU (measured 1.5-7x over (B, C, T) conv1d
  for the HiFi-GAN/BigVGAN shapes, transposed and depthwise convs included). Conv weights keep their
  1-D shape in the state dict; `reset_derived` stores them channels-last once (no second copy).
* Padded static shapes. Graphs run at a bucket length; the real input is ``length`` frames and the
  rest is padding. Every layer whose output near the end depends on what lies past the end must see
  what the unpadded run would have seen: a zero-padded conv needs zeros there (`ValidLength.zero`), a
  replicate-padded filter the last valid value (`ValidLength.hold`). Convs and resamplers take
  ``valid`` and fix up, in place, just the padding steps they can reach (their halo) before running;
  `EXACT` (the default) does nothing, for inputs that are not padded. Outputs past ``length`` are
  garbage and are trimmed by the caller.
* Receptive field. Each block reports how far (in samples of its input rate) an output reaches to
  the left and right (`Reach`); families add these up to declare the streaming context in frames.
* Derived tensors (snake frequencies, anti-alias filters) are non-persistent buffers computed in
  ``reset_derived()`` from the config and loaded weights (called by `flashrt.io.load_module`).

The numerics follow the public definitions: HiFi-GAN (Kong et al. 2020) ResBlock1/ResBlock2 with
leaky ReLU; Snake/SnakeBeta (Liu Ziyin et al. 2020) with optional log-scale parameters as in BigVGAN;
kaiser-windowed sinc low-pass filters (julius / alias-free-torch definition) for 2x anti-aliased
activations (BigVGAN v2, `Activation1d`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.io.transforms import weight_norm
from flashrt.io.weightmap import Rule
from flashrt.nn.spectral_conv import SpectralPlan

__all__ = [
    "EXACT", "ValidLength", "Reach", "ROWS", "to_rows", "from_rows", "get_padding", "Conv1d",
    "ConvTranspose1d", "polyphase_weight", "conv1d", "conv_transpose1d", "conv_rules",
    "WEIGHT_NORM_SOURCES", "ResBlock1", "ResBlock2", "mrf", "Snake", "SnakeBeta", "kaiser_sinc_filter1d",
    "UpSample1d", "DownSample1d", "Activation1d",
]


# ------------------------------------------------------------------------------------ valid length

class _Exact:
    """No padding: the tensors are exactly as long as the data. `zero`/`hold` return x unchanged."""

    def zero(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        return x

    def hold(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        return x

    def add_end(self, y: torch.Tensor, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        """y[..., -R:] += x[..., -1:] * gains (R = len(gains)), in place."""
        y[..., y.shape[-1] - gains.numel():].add_(x[..., -1:] * gains)
        return y

    def __repr__(self) -> str:
        return "EXACT"


EXACT = _Exact()


class ValidLength:
    """Where the real data ends on a padded time axis; built inside a captured fn for one forward.

    ``length`` is a static (1,) int64 buffer holding the valid number of frames (1..frames), ``frames``
    the padded number of frames of the graph. A tensor whose last axis is ``frames * r`` long (any rate
    r, e.g. after upsampling) has valid steps ``[0, end)``, ``end = length * r``; the rest is padding.

    * ``zero(x)`` / ``hold(x)``: a new tensor with all the padding set to 0 / to ``x[..., end - 1]``
      (replicate padding). Simple and safe anywhere.
    * ``zero(x, halo)`` / ``hold(x, halo)``: the same, in place, for just the steps ``[end, end + halo)``
      a layer's valid outputs can reach: constant cost instead of a pass over x. The rest of the
      padding holds garbage. Writing into the padding in place is safe as long as every layer that
      reads padding fixes it itself right before (tensors shared by several branches are then fixed
      by each in turn); the convs and resamplers of this module do. Steps past the axis are clamped
      onto its last step and write the value already there when it is a valid step.

    All ops are graph-safe (no host sync); index tensors are made once per (steps, halo) per forward.
    """

    def __init__(self, length: torch.Tensor, frames: int) -> None:
        self.length = length.reshape(1)
        self.frames = int(frames)
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _index(self, steps: int, halo: int) -> tuple[torch.Tensor, ...]:
        """(end (1,), last valid step (1,), fill steps (halo,) clamped, fill step is padding (halo,))."""
        found = self._cache.get((steps, halo))
        if found is None:
            rate, rem = divmod(steps, self.frames)
            if rem:
                raise ValueError(f"time axis {steps} is not a multiple of the {self.frames} padded frames")
            end = self.length * rate
            positions = torch.arange(max(halo, steps if halo == 0 else 0), device=end.device)
            fill = (end + positions).clamp_max(steps - 1) if halo else positions
            found = self._cache[(steps, halo)] = (end, (end - 1).clamp_min(0), fill, fill >= end)
        return found

    def zero(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        """x (..., T) with the padding (all, or its first `halo` steps in place) set to 0."""
        if halo is None:
            _, _, _, pad = self._index(x.shape[-1], 0)
            return x.masked_fill(pad, 0.0)
        if halo <= 0:
            return x
        _, _, fill, pad = self._index(x.shape[-1], halo)
        value = x.index_select(-1, fill).masked_fill_(pad, 0.0)            # keeps valid steps as they are
        return x.index_copy_(-1, fill, value)

    def add_end(self, y: torch.Tensor, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        """y[..., e_y - R + i] += x[..., e_x - 1] * gains[i] in place, e the real end on each tensor's axis:
        the replicate padding's share at the end of the data, added exactly as `EXACT.add_end` adds it
        at the end of an unpadded tensor (same products, same single add), so a padded window and an
        unpadded run of the same data round alike."""
        _, last, _, _ = self._index(x.shape[-1], 0)
        key = ("tail", y.shape[-1], gains.numel())
        pos = self._cache.get(key)
        if pos is None:
            end, _, _, _ = self._index(y.shape[-1], 0)
            steps = torch.arange(gains.numel(), device=end.device)
            pos = self._cache[key] = (end - gains.numel() + steps).clamp_min(0)
        return y.index_add_(-1, pos, x.index_select(-1, last) * gains)

    def hold(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        """x (..., T) with the padding (all, or its first `halo` steps in place) set to x[..., end - 1]."""
        if halo is not None and halo <= 0:
            return x
        _, last, fill, pad = self._index(x.shape[-1], 0 if halo is None else halo)
        edge = x.index_select(-1, last)                                      # (..., 1)
        if halo is None:
            return torch.where(pad, edge, x)
        value = torch.where(pad, edge, x.index_select(-1, fill))
        return x.index_copy_(-1, fill, value)


# ------------------------------------------------------------------------------------------ rows

ROWS = torch.channels_last


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) -> (B, C, 1, T) stored channels-last, the fast CPU layout (a copy)."""
    return x.unsqueeze(2).contiguous(memory_format=ROWS)


def from_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, T) -> (B, C, T) (a view)."""
    return x.squeeze(2)


# ---------------------------------------------------------------------------------- receptive field

@dataclass(frozen=True)
class Reach:
    """How far one output depends on inputs to its left and right, in frames (exact fractions)."""

    left: Fraction = Fraction(0)
    right: Fraction = Fraction(0)

    def __add__(self, other: Reach) -> Reach:
        return Reach(self.left + other.left, self.right + other.right)

    def frames(self) -> tuple[int, int]:
        """(left, right) rounded up to whole frames."""
        return math.ceil(self.left), math.ceil(self.right)

    @staticmethod
    def conv(kernel: int, dilation: int = 1, rate: int = 1, padding: int | None = None) -> Reach:
        """A stride-1 conv at `rate` samples per frame, with the given (default "same") left padding."""
        span = dilation * (kernel - 1)
        pad = get_padding(kernel, dilation) if padding is None else padding
        return Reach(Fraction(pad, rate), Fraction(span - pad, rate))

    @staticmethod
    def conv_transpose(kernel: int, stride: int, padding: int, rate: int = 1) -> Reach:
        """A transposed conv whose input runs at `rate` samples per frame (output at rate*stride)."""
        out_rate = rate * stride
        return Reach(Fraction(kernel - 1 - padding, out_rate), Fraction(padding, out_rate))

    @staticmethod
    def widest(reaches: Sequence[Reach]) -> Reach:
        """Parallel branches (summed outputs): the largest reach on each side."""
        return Reach(max(r.left for r in reaches), max(r.right for r in reaches))


# ------------------------------------------------------------------------------------------ convs

def get_padding(kernel: int, dilation: int = 1) -> int:
    """'Same' padding of a stride-1 conv: (kernel*dilation - dilation) // 2."""
    return (kernel * dilation - dilation) // 2


def _rows_weight(module: nn.Module) -> None:
    """Store the conv weight as a channels-last (out, in, 1, K) buffer; the 1-D parameter becomes a view
    of it (same values, same state-dict entry, no second copy)."""
    w = module.weight.detach()
    module.weight_rows = w.unsqueeze(2).contiguous(memory_format=ROWS)
    module.weight = nn.Parameter(module.weight_rows.squeeze(2), requires_grad=False)


def _fusable(x: torch.Tensor) -> bool:
    """oneDNN can fuse the epilogue (leaky ReLU, residual add) into this rows conv."""
    return _POINTWISE is not None and x.dim() == 4 and x.device.type == "cpu" and \
        (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _fused_bf16()))


@functools.cache
def _fused_bf16() -> bool:
    """Whether oneDNN's fused conv runs bf16 on this CPU (it needs avx512bw/vl/dq or avx_ne_convert;
    without them, bf16 rows convs take the plain conv2d path, which runs everywhere)."""
    x = torch.zeros(1, 1, 1, 4, dtype=torch.bfloat16).contiguous(memory_format=ROWS)
    w = torch.zeros(1, 1, 1, 3, dtype=torch.bfloat16).contiguous(memory_format=ROWS)
    try:
        _POINTWISE(x, w, None, [0, 0], [1, 1], [1, 1], 1, "none", [], "")
    except RuntimeError:
        return False
    return True


_POINTWISE = getattr(torch.ops.mkldnn, "_convolution_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None
_POINTWISE_INTO = getattr(torch.ops.mkldnn, "_convolution_pointwise_", None) \
    if torch.backends.mkldnn.is_available() else None


def _epilogue(y: torch.Tensor, slope: float | None, residual: torch.Tensor | None,
              into: bool) -> torch.Tensor:
    """leaky_relu(y, slope) and/or the residual add, unfused (y is a fresh tensor, changed in place)."""
    if slope is not None:
        y = F.leaky_relu_(y, slope)
    if residual is None:
        return y
    return residual.add_(y) if into else y.add_(residual)


class Conv1d(nn.Conv1d):
    """`nn.Conv1d` (same parameters and state dict) that also runs on rows and masks its padding halo.

    x: (B, Cin, T) or rows (B, Cin, 1, T) channels-last -> (B, Cout, T') in the same layout. With a
    `ValidLength`, the padding steps this conv's valid outputs reach are zeroed first (in place).
    Optional epilogue, fused into the oneDNN conv on CPU rows (else run after it, same math):
    ``slope`` applies leaky_relu(y, slope); ``residual`` returns y + residual (residual is not modified,
    unless ``into=True``: then y is added into ``residual`` in place and ``residual`` is returned, which
    saves allocating (and page-faulting) a fresh output where the caller owns the residual).

    Algorithms on CPU rows (chosen at load by `flashrt.nn.conv_policy`): oneDNN's direct conv (default);
    block-spectral GEMMs (`set_spectral`, float32); or, for a dilated conv, ``phase_split``: the same
    conv as an undilated (K, 1) conv over the (T/d, d) view of the sequence, whose summation order does
    not depend on the length or on where the sequence starts (oneDNN's dilated kernels' order does), so
    a window of a stream computes every sample exactly as the one-shot run does.
    """

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, *, stride: int = 1,
                 bias: bool = True, groups: int = 1, padding: int | None = None) -> None:
        pad = get_padding(kernel, dilation) if padding is None else padding
        super().__init__(cin, cout, kernel, stride=stride, padding=pad, dilation=dilation, bias=bias,
                         groups=groups)
        self.halo = dilation * (kernel - 1) - pad
        self.register_buffer("weight_rows", torch.empty(0), persistent=False)
        self.spectral_block: int | None = None
        self.spectral: SpectralPlan | None = None
        self.phase_split = False

    def reset_derived(self) -> None:
        _rows_weight(self)
        self.set_spectral(self.spectral_block)

    def set_spectral(self, block: int | None) -> None:
        """Run as a block-spectral conv of block size ``block`` on CPU float32 rows (None: direct). The
        plan is derived from the current weight (`reset_derived` rebuilds it)."""
        self.spectral_block = block
        self.spectral = None if block is None else \
            SpectralPlan(self.weight, self.dilation[0], self.padding[0], block)

    def can_phase_split(self) -> bool:
        """Dilated, stride 1, 'same' padding: the geometry `phase_split` handles."""
        d, k = self.dilation[0], self.kernel_size[0]
        return d > 1 and self.stride[0] == 1 and 2 * self.padding[0] == d * (k - 1)

    def forward(self, x: torch.Tensor, valid=EXACT, *, slope: float | None = None,
                residual: torch.Tensor | None = None, into: bool = False) -> torch.Tensor:
        x = valid.zero(x, self.halo)
        rows_cpu = x.dim() == 4 and x.device.type == "cpu"
        if self.spectral is not None and rows_cpu and x.dtype == torch.float32:
            y = self.spectral(x.contiguous(memory_format=ROWS), self.bias)
            return _epilogue(y, slope, residual, into)
        if self.phase_split and rows_cpu:
            return self._phases(x.contiguous(memory_format=ROWS), slope, residual, into)
        geometry = ([0, self.padding[0]], [1, self.stride[0]], [1, self.dilation[0]], self.groups)
        if _fusable(x) and (slope is None or residual is None):
            return _fused_conv(x, self.weight_rows, self.bias, geometry, slope, residual, into)
        pad, stride, dilation, groups = geometry
        y = super().forward(x) if x.dim() == 3 else F.conv2d(x, self.weight_rows, self.bias, stride, pad,
                                                             dilation, groups)
        return _epilogue(y, slope, residual, into)

    def _phases(self, x: torch.Tensor, slope: float | None, residual: torch.Tensor | None,
                into: bool) -> torch.Tensor:
        """The dilated conv on the (B, C, T/d, d) view of rows x (end padded to a multiple of d)."""
        d, (b, c, _, t) = self.dilation[0], x.shape
        steps = -(-t // d) * d
        seq = x.permute(0, 2, 3, 1).reshape(b, t, c)                          # (B, T, C), no copy
        if steps != t:
            seq = F.pad(seq, (0, 0, 0, steps - t))
        image = seq.view(b, steps // d, d, c).permute(0, 3, 1, 2)            # (B, C, T/d, d) channels-last
        weight = self.weight_rows.squeeze(2).unsqueeze(3)                     # (O, C, K, 1), same memory
        geometry = ([self.padding[0] // d, 0], [1, 1], [1, 1], self.groups)
        fuse = _fusable(image) and (slope is None or residual is None) and \
            (residual is None or (steps == t and residual.is_contiguous(memory_format=ROWS)))
        if fuse:
            res = None if residual is None else _as_phases(residual, d)
            y = _fused_conv(image, weight, self.bias, geometry, slope, res, into)
            return residual if into and residual is not None else _phases_to_rows(y, t)
        y = _phases_to_rows(F.conv2d(image, weight, self.bias, 1, geometry[0], 1, self.groups), t)
        return _epilogue(y, slope, residual, into)


def _as_phases(rows: torch.Tensor, d: int) -> torch.Tensor:
    """Rows (B, C, 1, T) channels-last contiguous, T a multiple of d -> the (B, C, T/d, d) view of it."""
    b, c, _, t = rows.shape
    return rows.permute(0, 2, 3, 1).reshape(b, t // d, d, c).permute(0, 3, 1, 2)


def _phases_to_rows(y: torch.Tensor, t: int) -> torch.Tensor:
    """(B, O, T'/d, d) channels-last -> rows (B, O, 1, t) of its first t steps."""
    b, o = y.shape[:2]
    rows = y.permute(0, 2, 3, 1).reshape(b, -1, o)[:, :t].permute(0, 2, 1).unsqueeze(2)
    return rows if b == 1 else rows.contiguous(memory_format=ROWS)


def _fused_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: tuple,
                slope: float | None, residual: torch.Tensor | None, into: bool = False) -> torch.Tensor:
    """One oneDNN conv (2-D channels-last ``geometry`` = padding, stride, dilation, groups) with the
    leaky-relu or residual-add epilogue fused."""
    if residual is None:
        attr, scalars = ("none", []) if slope is None else ("leaky_relu", [slope])
        return _POINTWISE(x, weight, bias, *geometry, attr, scalars, "")
    args = (weight, bias, *geometry, "add", None, None, [], None)
    if into and _POINTWISE_INTO is not None and residual.is_contiguous(memory_format=ROWS):
        return _POINTWISE_INTO.binary(residual, x, *args)            # oneDNN sum into the residual's memory
    y = _POINTWISE.binary(x, residual, *args)
    return residual.copy_(y) if into else y


class ConvTranspose1d(nn.ConvTranspose1d):
    """`nn.ConvTranspose1d` on (B, C, T) or rows; the HiFi-GAN/BigVGAN upsampler: padding (K - stride)/2,
    so T' = T x stride. With a `ValidLength`, the padding steps its valid outputs reach are zeroed first.

    ``polyphase`` (set by `set_polyphase`, from the ``invariant`` conv policy): on CPU rows, run it as one
    undilated stride-1 conv with stride x Cout output channels (output phase p of step t is channel block
    p; `polyphase_weight`), whose (B, T, stride, Cout) result is the upsampled sequence in place. Its
    summation order does not depend on the length or start of the sequence (oneDNN's transposed conv's
    does); it costs ceil(K / stride + 1) / (K / stride) the FLOPs (1.5x for K = 2 stride).
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        if (kernel - stride) % 2:
            raise ValueError(f"upsampler kernel {kernel} and stride {stride} must differ by an even number")
        super().__init__(cin, cout, kernel, stride, padding=(kernel - stride) // 2)
        self.halo = -(-self.padding[0] // stride) + 1
        self.register_buffer("weight_rows", torch.empty(0), persistent=False)
        self.register_buffer("poly_rows", torch.empty(0), persistent=False)
        self.register_buffer("poly_bias", None, persistent=False)
        self.polyphase = False
        self.poly_pad = (0, 0)

    def reset_derived(self) -> None:
        _rows_weight(self)
        self.set_polyphase(self.polyphase)

    def set_polyphase(self, on: bool) -> None:
        """Run as the polyphase stride-1 conv on CPU rows (True) or as oneDNN's transposed conv."""
        self.polyphase = bool(on)
        if not on:
            self.poly_rows, self.poly_bias = torch.empty(0), None
            return
        weight, left, right = polyphase_weight(self.weight.detach(), self.stride[0], self.padding[0])
        self.poly_rows = weight.unsqueeze(2).contiguous(memory_format=ROWS)          # (s O, C, 1, M)
        self.poly_bias = None if self.bias is None else self.bias.detach().repeat(self.stride[0])
        self.poly_pad = (left, right)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        x = valid.zero(x, self.halo)
        if x.dim() == 3:
            return super().forward(x)
        if self.polyphase and x.device.type == "cpu":
            return self._polyphase(x)
        return F.conv_transpose2d(x, self.weight_rows, self.bias, (1, self.stride[0]), (0, self.padding[0]))

    def _polyphase(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.poly_pad
        if left != right:
            x, left = F.pad(x, (left, right)).contiguous(memory_format=ROWS), 0
        y = F.conv2d(x, self.poly_rows, self.poly_bias, padding=(0, left))          # (B, s O, 1, T)
        b, _, _, t = y.shape
        seq = y.contiguous(memory_format=ROWS).permute(0, 2, 3, 1)                 # (B, 1, T, s O)
        return seq.reshape(b, t * self.stride[0], self.out_channels).permute(0, 2, 1).unsqueeze(2)


def polyphase_weight(weight: torch.Tensor, stride: int, padding: int) -> tuple[torch.Tensor, int, int]:
    """A transposed conv's weight (Cin, Cout, K) as the weight (stride Cout, Cin, M) of an undilated conv
    over the input whose output channel p Cout + o is output step t stride + p, channel o; with the zero
    padding (left, right) that conv needs. Output n = t s + p takes x[i] w[k] with k = n + padding - i s,
    i.e. x[t + m], m = (p + padding) // s - j, k = j s + (p + padding) % s for every j with k < K."""
    cin, cout, kernel = weight.shape
    taps = {}
    for p in range(stride):
        shift, phase = divmod(p + padding, stride)
        for j in range(-(-(kernel - phase) // stride)):
            taps[(p, shift - j)] = j * stride + phase
    low, high = min(m for _, m in taps), max(m for _, m in taps)
    out = weight.new_zeros(stride, cout, cin, high - low + 1)
    for (p, m), k in taps.items():
        out[p, :, :, m - low] = weight[:, :, k].T
    return out.reshape(stride * cout, cin, high - low + 1), -low, high


def conv1d(cin: int, cout: int, kernel: int, dilation: int = 1, bias: bool = True, groups: int = 1) -> Conv1d:
    """A stride-1 `Conv1d` with 'same' zero padding."""
    return Conv1d(cin, cout, kernel, dilation, bias=bias, groups=groups)


def conv_transpose1d(cin: int, cout: int, kernel: int, stride: int) -> ConvTranspose1d:
    """The upsampler: output length = input length x stride (needs kernel - stride even)."""
    return ConvTranspose1d(cin, cout, kernel, stride)


WEIGHT_NORM_SOURCES: dict[str, tuple[str, ...]] = {
    "plain": ("weight",),
    "legacy": ("weight_g", "weight_v"),
    "parametrized": ("parametrizations.weight.original0", "parametrizations.weight.original1"),
}


def conv_rules(source: str, target: str, bias: bool = True) -> list[Rule]:
    """Rules mapping one conv's weight (any weight-norm form, folded once) and bias.

    ``source``/``target`` are layer templates without the tensor name, e.g.
    ``conv_rules("resblocks.{i}.convs1.{j}", "resblocks.{i}.convs1.{j}")``. One rule per stored form;
    only the form present in the checkpoint produces the weight (two forms at once is a conflict).
    """
    rules, dst = [], f"{target}." if target else ""
    for names in WEIGHT_NORM_SOURCES.values():
        sources = tuple(f"{source}.{n}" for n in names)
        transform = weight_norm(0) if len(sources) == 2 else None
        rules.append(Rule(sources if len(sources) > 1 else sources[0], f"{dst}weight", transform))
    if bias:
        rules.append(Rule(f"{source}.bias", f"{dst}bias"))
    return rules


# ---------------------------------------------------------------------------- leaky-relu resblocks

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

    @staticmethod
    def reach(kernel: int, dilations: Sequence[int], rate: int = 1) -> Reach:
        return sum((Reach.conv(kernel, d, rate) + Reach.conv(kernel, 1, rate) for d in dilations), Reach())


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

    @staticmethod
    def reach(kernel: int, dilations: Sequence[int], rate: int = 1) -> Reach:
        return sum((Reach.conv(kernel, d, rate) for d in dilations), Reach())


def mrf(blocks: Sequence[nn.Module], x: torch.Tensor, valid=EXACT, **shared: torch.Tensor) -> torch.Tensor:
    """Multi-receptive-field fusion: the mean of parallel residual blocks applied to the same x.

    ``shared`` tensors (e.g. ``activated=lrelu(x)``), computed once by the caller, go to every block.
    """
    out = blocks[0](x, valid, **shared)
    for block in blocks[1:]:
        out.add_(block(x, valid, **shared))
    return out.div_(len(blocks))


# ----------------------------------------------------------------------------------------- snake

class Snake(nn.Module):
    """x + 1/(a + 1e-9) * sin(a x)^2 per channel; with ``logscale`` the stored alpha is log(a).

    (B, C, T) -> (B, C, T). ``alpha`` is (C,) as stored by BigVGAN/DAC-style checkpoints.
    """

    eps = 1e-9

    def __init__(self, channels: int, logscale: bool = True) -> None:
        super().__init__()
        self.logscale = logscale
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.register_buffer("freq", torch.empty(channels, 1), persistent=False)   # (C, 1)
        self.register_buffer("inv", torch.empty(channels, 1), persistent=False)    # (C, 1)

    def _scale(self, p: torch.Tensor) -> torch.Tensor:
        return torch.exp(p) if self.logscale else p

    def reset_derived(self) -> None:
        a = self._scale(self.alpha.detach()).reshape(-1, 1)
        self.freq = a.clone()
        self.inv = 1.0 / (a + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (-1,) + (1,) * (x.dim() - 2)              # (C, 1) or (C, 1, 1) for rows
        t = x * self.freq.view(shape)
        t.sin_().square_().mul_(self.inv.view(shape))
        return t.add_(x)


class SnakeBeta(Snake):
    """x + 1/(b + 1e-9) * sin(a x)^2: separate frequency (alpha) and magnitude (beta), both (C,)."""

    def __init__(self, channels: int, logscale: bool = True) -> None:
        super().__init__(channels, logscale)
        self.beta = nn.Parameter(torch.zeros(channels))

    def reset_derived(self) -> None:
        self.freq = self._scale(self.alpha.detach()).reshape(-1, 1).clone()
        self.inv = 1.0 / (self._scale(self.beta.detach()).reshape(-1, 1) + self.eps)


# ------------------------------------------------------------------------------- anti-aliasing

def kaiser_sinc_filter1d(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass filter, normalized to unit DC gain. Returns (K,) float32.

    ``cutoff`` and ``half_width`` are in cycles per sample (0.5 = Nyquist); the Kaiser beta follows
    the usual attenuation formula A = 2.285 (K/2 - 1) pi (4 half_width) + 7.95.
    """
    even = kernel_size % 2 == 0
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    window = torch.kaiser_window(kernel_size, beta=_kaiser_beta(attenuation), periodic=False)
    time = torch.arange(-half, half) + 0.5 if even else torch.arange(kernel_size) - half
    if cutoff == 0:
        return torch.zeros(kernel_size)
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return filt / filt.sum()


def _kaiser_beta(attenuation: float) -> float:
    if attenuation > 50.0:
        return 0.1102 * (attenuation - 8.7)
    if attenuation >= 21.0:
        return 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    return 0.0


def _edge_gains(definition, zero_padded, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """How much the replicate padding of `definition` adds, per output near each end, per unit of the
    edge value, over the same filter run with zero padding (`zero_padded`). Found by running both on a
    constant signal in float64 (load time). None when the two disagree in length (no shortcut)."""
    ones = torch.ones(1, 1, 4 * kernel_size, dtype=torch.float64)
    exact, zero = definition(ones), zero_padded(ones)
    if exact.shape != zero.shape:
        return None
    diff = (exact - zero).flatten()
    half = diff.numel() // 2
    left, right = diff[:half], diff[half:].flip(0)
    return left[:_extent(left)], right[:_extent(right)].flip(0)


def _extent(d: torch.Tensor) -> int:
    """1 + the index of the last entry that is not (numerically) zero; 0 if none."""
    hits = torch.nonzero(d.abs() > 1e-12)
    return int(hits.max()) + 1 if hits.numel() else 0


def _add_edges(x: torch.Tensor, y: torch.Tensor, gains: tuple[torch.Tensor, torch.Tensor],
               valid=EXACT) -> torch.Tensor:
    """y (zero-padded filter output) plus the replicate-padding contribution of x's first value and of
    its last real value (the end of the tensor, or where `valid` says the data ends)."""
    left, right = gains
    y[..., :left.numel()].add_(x[..., :1] * left)
    return valid.add_end(y, x, right)


def _cast_filters(module: nn.Module, dtype: torch.dtype) -> None:
    """Derived filters follow the dtype of the weights they run with (e.g. bf16 after a bf16 load)."""
    module.filter = module.filter.to(dtype)
    module.filter_rows = module.filter_rows.to(dtype).contiguous(memory_format=ROWS)
    if module.gains is not None:
        module.gains = tuple(g.to(dtype) for g in module.gains)


class UpSample1d(nn.Module):
    """Band-limited x`ratio` upsampling: replicate pad, depthwise transposed conv, trim.

    (B, C, T) -> (B, C, T*ratio), or the same on rows (B, C, 1, T). The filter (C, 1, K) is derived (not
    stored) and pre-scaled by ratio (exact for the usual ratio 2). With a `ValidLength` the replicate
    padding is re-created at the real end of the data (`hold`) before filtering. On rows the padding
    copy is skipped: the transposed conv runs with zero padding and the replicate padding's share is
    added at the few outputs near each end (gains derived at load from the definition above).
    """

    def __init__(self, channels: int, ratio: int = 2, kernel_size: int | None = None) -> None:
        super().__init__()
        self.channels, self.ratio = channels, ratio
        self.kernel_size = int(6 * ratio // 2) * 2 if kernel_size is None else kernel_size
        self.pad = self.kernel_size // ratio - 1
        self.trim_left = self.pad * ratio + (self.kernel_size - ratio) // 2
        self.trim_right = self.pad * ratio + (self.kernel_size - ratio + 1) // 2
        self.zero_pad = self.trim_left - self.pad * ratio        # output trim of the un-padded conv
        self.register_buffer("filter", torch.empty(channels, 1, self.kernel_size), persistent=False)
        self.register_buffer("filter_rows", torch.empty(0), persistent=False)
        self.gains: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset_derived(self) -> None:
        f = kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)
        self.filter = (self.ratio * f).to(self.filter.dtype).expand(self.channels, 1, -1).contiguous()
        self.filter_rows = self.filter.unsqueeze(2).contiguous(memory_format=ROWS)
        f64 = (self.ratio * f).double().view(1, 1, -1)
        gains = None
        if self.trim_left == self.trim_right:
            zero = lambda x: F.conv_transpose1d(x, f64, stride=self.ratio, padding=self.zero_pad)
            gains = _edge_gains(lambda x: self._padded(x, f64), zero, self.kernel_size)
        self.gains = None if gains is None else tuple(g.to(self.filter) for g in gains)

    def _padded(self, x: torch.Tensor, filt: torch.Tensor) -> torch.Tensor:
        """The definition on (B, C, T): replicate pad, transposed conv, trim."""
        y = F.conv_transpose1d(F.pad(x, (self.pad, self.pad), mode="replicate"), filt, stride=self.ratio,
                               groups=x.shape[1])
        return y[..., self.trim_left:y.shape[-1] - self.trim_right]

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        if x.dim() == 3 or self.gains is None or x.shape[-1] < self.kernel_size:
            x = valid.hold(x, self.pad)
            if x.dim() == 3:
                return self._padded(x, self.filter)
            y = F.conv_transpose2d(F.pad(x, (self.pad, self.pad, 0, 0), mode="replicate"), self.filter_rows,
                                   stride=(1, self.ratio), groups=self.channels)
            return y[..., self.trim_left:y.shape[-1] - self.trim_right]
        x = valid.zero(x, self.pad)                  # zeros past the data, the edge's share added after
        y = F.conv_transpose2d(x, self.filter_rows, stride=(1, self.ratio), padding=(0, self.zero_pad),
                               groups=self.channels)
        return _add_edges(x, y, self.gains, valid)

    @staticmethod
    def reach(ratio: int = 2, kernel_size: int = 12, rate: int = 1) -> Reach:
        """Bound on the reach, in frames, for an input at `rate` samples per frame."""
        half = Fraction(kernel_size, 2 * ratio)
        return Reach(half / rate, half / rate)


class DownSample1d(nn.Module):
    """Band-limited /`ratio` downsampling: replicate pad, depthwise low-pass conv with stride.

    (B, C, T*ratio) -> (B, C, T), or the same on rows. With a `ValidLength` the replicate padding is
    re-created at the real end of the data (`hold`) before filtering. On rows the padding copy is
    skipped as in `UpSample1d` (zero-padded conv plus the edge values' share near each end).
    """

    def __init__(self, channels: int, ratio: int = 2, kernel_size: int | None = None) -> None:
        super().__init__()
        self.channels, self.ratio = channels, ratio
        self.kernel_size = int(6 * ratio // 2) * 2 if kernel_size is None else kernel_size
        even = self.kernel_size % 2 == 0
        self.pad_left, self.pad_right = self.kernel_size // 2 - int(even), self.kernel_size // 2
        self.register_buffer("filter", torch.empty(channels, 1, self.kernel_size), persistent=False)
        self.register_buffer("filter_rows", torch.empty(0), persistent=False)
        self.gains: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset_derived(self) -> None:
        f = kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)
        self.filter = f.to(self.filter.dtype).expand(self.channels, 1, -1).contiguous()
        self.filter_rows = self.filter.unsqueeze(2).contiguous(memory_format=ROWS)
        f64 = f.double().view(1, 1, -1)
        gains = _edge_gains(lambda x: self._padded(x, f64),
                            lambda x: F.conv1d(x, f64, stride=self.ratio, padding=self.pad_left),
                            self.kernel_size)
        self.gains = None if gains is None else tuple(g.to(self.filter) for g in gains)

    def _padded(self, x: torch.Tensor, filt: torch.Tensor) -> torch.Tensor:
        """The definition on (B, C, T*ratio): replicate pad, strided low-pass."""
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, filt, stride=self.ratio, groups=x.shape[1])

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        if x.dim() == 3 or self.gains is None or x.shape[-1] < 2 * self.kernel_size:
            x = valid.hold(x, self.pad_right)
            if x.dim() == 3:
                return self._padded(x, self.filter)
            x = F.pad(x, (self.pad_left, self.pad_right, 0, 0), mode="replicate")
            return F.conv2d(x, self.filter_rows, stride=(1, self.ratio), groups=self.channels)
        x = valid.zero(x, self.pad_right)            # zeros past the data, the edge's share added after
        y = F.conv2d(x, self.filter_rows, stride=(1, self.ratio), padding=(0, self.pad_left),
                     groups=self.channels)
        return _add_edges(x, y, self.gains, valid)

    @staticmethod
    def reach(ratio: int = 2, kernel_size: int = 12, rate: int = 1) -> Reach:
        """`rate` is the samples-per-frame of the (high-rate) input."""
        return Reach(Fraction(kernel_size // 2, rate), Fraction(kernel_size // 2, rate))


class Activation1d(nn.Module):
    """Anti-aliased activation: upsample x2, pointwise activation, low-pass and downsample x2.

    (B, C, T) -> (B, C, T). ``act`` is a Snake/SnakeBeta (its parameters are ``act.alpha``/``act.beta``).
    """

    def __init__(self, channels: int, act: nn.Module, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        self.act = act
        self.upsample = UpSample1d(channels, ratio, kernel_size)
        self.downsample = DownSample1d(channels, ratio, kernel_size)

    def reset_derived(self) -> None:
        """Runs after the resamplers' own (children first): their filters take the activation's dtype."""
        dtype = next(self.act.parameters()).dtype
        _cast_filters(self.upsample, dtype)
        _cast_filters(self.downsample, dtype)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x, valid)), valid)

    @staticmethod
    def reach(ratio: int = 2, kernel_size: int = 12, rate: int = 1) -> Reach:
        up = UpSample1d.reach(ratio, kernel_size, rate)
        return up + DownSample1d.reach(ratio, kernel_size, rate * ratio)
