"""1-D convolutions of the audio stack on (B, C, T) or channels-last "rows", with padding fix-ups.

Layout. Every conv takes (B, C, T) or "rows": (B, C, 1, T) stored channels-last (`to_rows`), the layout
in which oneDNN runs these 1-D convs fastest on CPU (measured faster than (B, C, T) conv1d for the
HiFi-GAN/BigVGAN shapes, transposed and depthwise convs included). Conv weights keep their 1-D shape in
the state dict; `reset_derived` stores them channels-last once (no second copy). Weight norm is never a
module parametrization: `conv_rules` maps the three stored forms and folds g, v once at load.

Forms recorded for export (`plain_forms`): the ``invariant`` conv policy's phase-split dilated convs and
polyphase upsamplers are oneDNN workarounds (its dilated and transposed kernels add in an order that
depends on where a sequence starts). A program recorded for another runtime (`flashrt.runtime.onnx_export`
enters `plain_forms`) records every conv as what it is, one dilated conv or one transposed conv (ONNX
Conv / ConvTranspose), and leaves the summation order to that runtime's kernels; the phase-split and
polyphase forms there were a dozen reshapes and transposes each. The block-spectral convs
(`flashrt.nn.spectral_conv`) are likewise an algorithm chosen for oneDNN and MKL on this CPU, and record
as the plain conv too (faster on onnxruntime and quicker to export: docs/benchmarks/vocoders.md).
Eager runs are unchanged.

Shape legend: B batch, C channels, T time steps at the conv's own rate, K kernel taps.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.io.transforms import weight_norm
from flashrt.io.weightmap import Rule
from flashrt.nn.reach import Reach, get_padding
from flashrt.nn.spectral_conv import MIN_BLOCKS, SpectralPlan
from flashrt.nn.valid import EXACT
from flashrt.nn.winograd_conv import WinogradPlan
from flashrt.ops import Op, register

__all__ = ["ROWS", "to_rows", "from_rows", "Conv1d", "ConvTranspose1d", "polyphase_weight", "conv1d",
           "conv_transpose1d", "conv_rules", "WEIGHT_NORM_SOURCES", "plain_forms", "CONV1D"]

# ------------------------------------------------------------------------------------------ forms

_FORMS = threading.local()   # .plain: inside `plain_forms` on this thread (an export elsewhere leaves it)


def _plain() -> bool:
    return getattr(_FORMS, "plain", False)


@contextlib.contextmanager
def plain_forms() -> Iterator[None]:
    """Inside the block every conv runs its plain form whatever its policy chose: a phase-split dilated
    conv as one dilated conv, a polyphase upsampler as one transposed conv, a spectral conv as the conv
    it computes (see the module docstring). Entered while a program is recorded for export; per thread,
    so a model serving eager calls while another thread exports keeps its own forms."""
    before, _FORMS.plain = _plain(), True
    try:
        yield
    finally:
        _FORMS.plain = before


# the convs' export form: `flashrt.ops.portable_forms` (which an export enters) enters `plain_forms`
CONV1D = register(Op("conv1d", F.conv1d, reference_name="plain", portable=plain_forms))

# ------------------------------------------------------------------------------------------ rows

ROWS = torch.channels_last


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) -> (B, C, 1, T) stored channels-last, the fast CPU layout (a copy)."""
    return x.unsqueeze(2).contiguous(memory_format=ROWS)


def from_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, T) -> (B, C, T) (a view)."""
    return x.squeeze(2)


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


_REORDER = getattr(torch.ops.mkldnn, "_reorder_convolution_weight", None) \
    if torch.backends.mkldnn.is_available() else None


def _packed(weight: torch.Tensor, geometry: tuple) -> torch.Tensor | None:
    """``weight`` (O, C/g, kh, kw) reordered once into oneDNN's blocked layout for a 2-D channels-last conv
    of ``geometry`` (padding, stride, dilation, groups), or None where that does not apply (not a CPU
    float32 weight, no oneDNN). A plain weight is reordered by oneDNN on every call: at a few frames
    that was most of BigVGAN's call; the packed one is
    the same values, so the conv's results are bit for bit the same (tests/nn/test_audio.py)."""
    if _REORDER is None or _POINTWISE is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    pad, stride, dilation, groups = geometry
    size = [1, weight.shape[1] * groups, 1 + (weight.shape[2] - 1) * dilation[0], 64]
    return _REORDER(weight.detach(), pad, stride, dilation, groups, size)


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
    `ValidLength`, the padding steps this conv's valid outputs reach are zeroed first (in place); for a
    spectral or Winograd form, every step its valid outputs' blocks or tiles read (the plan's ``halo``),
    since their rounding depends on all of them: a valid output never depends on stale padding.
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
        self.spectral_min_blocks = MIN_BLOCKS       # calls of fewer block rows run direct (`SpectralPlan`)
        self.spectral: SpectralPlan | None = None
        self.spectral_short_block: tuple[int, int] | None = None   # (N, min rows) of the short-call plan
        self.spectral_short: SpectralPlan | None = None             # tried when `spectral` does not engage
        self.winograd: WinogradPlan | None = None   # the 3-tap F(4, 3) form (`set_winograd`)
        self.phase_split = False
        self.packed: torch.Tensor | None = None     # weight_rows (or its phase view) in oneDNN's layout
        self.packed_phases = False                  # which of the two `packed` holds

    def reset_derived(self) -> None:
        _rows_weight(self)
        self.set_spectral(self.spectral_block, self.spectral_min_blocks, self.spectral_short_block)
        self.set_winograd(self.winograd is not None)

    def _geometry(self) -> tuple:
        """(padding, stride, dilation, groups) of the 2-D conv on rows."""
        return [0, self.padding[0]], [1, self.stride[0]], [1, self.dilation[0]], self.groups

    def _phase_geometry(self) -> tuple:
        return [self.padding[0] // self.dilation[0], 0], [1, 1], [1, 1], self.groups

    def pack(self) -> None:
        """Reorder the weight once for the algorithm this conv runs (`flashrt.nn.conv_policy` calls it
        after choosing; `reset_derived` after a load): the direct or the phase-split conv's weight in
        oneDNN's layout (a spectral conv's too: its calls of too few block rows run the direct conv)."""
        self.packed_phases = self.phase_split
        if not self.weight_rows.numel():
            self.packed = None
        elif self.phase_split:
            self.packed = _packed(self._phase_weight(), self._phase_geometry())
        else:
            self.packed = _packed(self.weight_rows, self._geometry())

    def _phase_weight(self) -> torch.Tensor:
        return self.weight_rows.squeeze(2).unsqueeze(3)                      # (O, C, K, 1), same memory

    def _weight_for(self, x: torch.Tensor, phase: bool) -> torch.Tensor:
        """The packed weight for a float32 call where it was packed for this form (``phase``: the
        phase-split conv's), else the plain one."""
        if self.packed is not None and x.dtype == torch.float32 and phase == self.packed_phases:
            return self.packed
        return self._phase_weight() if phase else self.weight_rows

    def set_spectral(self, block: int | None, min_blocks: int = MIN_BLOCKS,
                     short: tuple[int, int] | None = None) -> None:
        """Run as a block-spectral conv of block size ``block`` on CPU float32 rows (None: direct), calls
        of fewer than ``min_blocks`` block rows at the plan of ``short`` = (N, min rows) if given and they
        have that many rows there, else direct (`SpectralPolicy.blocks`). The plans are derived from the
        current weight (`reset_derived` rebuilds them with the same blocks and thresholds)."""
        self.spectral_block, self.spectral_min_blocks = block, min_blocks
        self.spectral_short_block = short if block is not None else None
        geometry = self.dilation[0], self.padding[0]
        self.spectral = None if block is None else \
            SpectralPlan(self.weight, *geometry, block, self.bias, min_blocks)
        self.spectral_short = None if self.spectral_short_block is None else \
            SpectralPlan(self.weight, *geometry, short[0], self.bias, short[1])
        self.pack()

    def set_winograd(self, on: bool) -> None:
        """Run this 3-tap conv as Winograd F(4, 3) on plain eager CPU float32 rows (`WinogradPlan`),
        derived from the current weight (`reset_derived` rebuilds it)."""
        self.winograd = WinogradPlan(self.weight, self.dilation[0], self.bias) if on else None

    def _spectral_plan(self, x: torch.Tensor) -> SpectralPlan | None:
        """The plan this call runs (the first of `spectral`, `spectral_short` that engages), or None."""
        for plan in (self.spectral, self.spectral_short):
            if plan is not None and plan.engages(x):
                return plan
        return None

    def _transform(self, x: torch.Tensor) -> SpectralPlan | WinogradPlan | None:
        """The transform form (spectral or Winograd) this call runs, or None (a direct form). Decided by
        x's shape, dtype and the calling mode only, never by its values."""
        if _plain() or x.dim() != 4 or x.device.type != "cpu":
            return None
        if self.spectral is not None and x.dtype == torch.float32:
            plan = self._spectral_plan(x)
            if plan is not None:
                return plan
        return self.winograd if self.winograd is not None and self.winograd.engages(x) else None

    def reach(self, rate: int = 1) -> Reach:
        """Frames an output reaches at `rate` samples per frame (its kernel, dilation and padding)."""
        return Reach.conv(self.kernel_size[0], self.dilation[0], rate, self.padding[0])

    def can_phase_split(self) -> bool:
        """Dilated, stride 1, 'same' padding: the geometry `phase_split` handles."""
        d, k = self.dilation[0], self.kernel_size[0]
        return d > 1 and self.stride[0] == 1 and 2 * self.padding[0] == d * (k - 1)

    def forward(self, x: torch.Tensor, valid=EXACT, *, slope: float | None = None,
                residual: torch.Tensor | None = None, into: bool = False) -> torch.Tensor:
        form = self._transform(x)
        x = valid.zero(x, self.halo if form is None else max(self.halo, form.halo))
        if form is not None:
            return _epilogue(form(x.contiguous(memory_format=ROWS)), slope, residual, into)
        rows_cpu = x.dim() == 4 and x.device.type == "cpu"
        if self.phase_split and rows_cpu and not _plain():
            return self._phases(x.contiguous(memory_format=ROWS), slope, residual, into)
        geometry = self._geometry()
        if _fusable(x) and (slope is None or residual is None):
            return _fused_conv(x, self._weight_for(x, False), self.bias, geometry, slope, residual, into)
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
        geometry = self._phase_geometry()
        fuse = _fusable(image) and (slope is None or residual is None) and \
            (residual is None or (steps == t and residual.is_contiguous(memory_format=ROWS)))
        if fuse:
            res = None if residual is None else _as_phases(residual, d)
            y = _fused_conv(image, self._weight_for(image, True), self.bias, geometry, slope, res, into)
            return residual if into and residual is not None else _phases_to_rows(y, t)
        y = F.conv2d(image, self._phase_weight(), self.bias, 1, geometry[0], 1, self.groups)
        y = _phases_to_rows(y, t)
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
        self.poly_packed: torch.Tensor | None = None     # poly_rows in oneDNN's layout (`_packed`)

    def reset_derived(self) -> None:
        _rows_weight(self)
        self.set_polyphase(self.polyphase)

    def reach(self, rate: int = 1) -> Reach:
        """Frames an output reaches, for an input at `rate` samples per frame (output at rate x stride)."""
        return Reach.conv_transpose(self.kernel_size[0], self.stride[0], self.padding[0], rate)

    def set_polyphase(self, on: bool) -> None:
        """Run as the polyphase stride-1 conv on CPU rows (True) or as oneDNN's transposed conv."""
        self.polyphase = bool(on)
        if not on:
            self.poly_rows, self.poly_bias, self.poly_packed = torch.empty(0), None, None
            return
        weight, left, right = polyphase_weight(self.weight.detach(), self.stride[0], self.padding[0])
        self.poly_rows = weight.unsqueeze(2).contiguous(memory_format=ROWS)          # (s O, C, 1, M)
        self.poly_bias = None if self.bias is None else self.bias.detach().repeat(self.stride[0])
        self.poly_pad = (left, right)
        self.poly_packed = _packed(self.poly_rows, self._poly_geometry())

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        x = valid.zero(x, self.halo)
        if x.dim() == 3:
            return super().forward(x)
        if self.polyphase and x.device.type == "cpu" and not _plain():
            return self._polyphase(x)
        return F.conv_transpose2d(x, self.weight_rows, self.bias, (1, self.stride[0]), (0, self.padding[0]))

    def _poly_geometry(self) -> tuple:
        """The polyphase conv's (padding, stride, dilation, groups); asymmetric padding is applied to x."""
        left, right = self.poly_pad
        return [0, left if left == right else 0], [1, 1], [1, 1], 1

    def _polyphase(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.poly_pad
        if left != right:
            x, left = F.pad(x, (left, right)).contiguous(memory_format=ROWS), 0
        if self.poly_packed is not None and x.dtype == torch.float32 and _fusable(x):
            y = _POINTWISE(x, self.poly_packed, self.poly_bias, *self._poly_geometry(), "none", [], "")
        else:
            y = F.conv2d(x, self.poly_rows, self.poly_bias, padding=(0, left))      # (B, s O, 1, T)
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
