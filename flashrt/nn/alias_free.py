"""Snake activations and BigVGAN's anti-aliased activation: band-limited 2x up, activation, 2x down.

Snake/SnakeBeta (Liu Ziyin et al. 2020) with optional log-scale parameters as in BigVGAN;
kaiser-windowed sinc low-pass filters (julius / alias-free-torch definition) for 2x anti-aliased
activations (BigVGAN v2, `Activation1d`). Derived tensors (snake frequencies, filters) are
non-persistent buffers computed in ``reset_derived()``.

Host sine (`SINES`): the snake's sine is the bulk of its cost on the CPU (ATen's float32 ``sin`` is MKL's
VML kernel, which NumPy's own vectorized float32 sine beats on some CPUs:
docs/benchmarks/vocoders.md). ``Snake.sine = "numpy"`` runs it through NumPy in place over the tensor's
memory taken as one flat array (a value's sine depends on the value only, not on where it lies: stream ==
one-shot stays exact), where that is possible: a plain eager call on a dense CPU float32 tensor without
autograd; under a recording mode (the trace backend, FLOP counters, export) or anywhere else it is ATen's
``sin_``, so a recorded graph always holds the op. The two sines differ in the last bit of ~13 % of the
values. The sine is an op (`SNAKE_SINE`, slot ``Snake.sine``): its "numpy" form is chosen by
`flashrt.ops.select` for CPU float32 where `pick_sine` (which measures both once per process) says so.

Native kernel: the "native" form of the op `AA_SNAKE` (slot ``Activation1d.aa_snake``) runs the whole
anti-aliased
snake (2x upsample, snake, low-pass 2x down) as one pass of the C kernel csrc/anti_alias_cpu.c
(`flashrt.ops.csrc_cpu`, built with the machine's C compiler on first use): the upsampled signal
stays in the cache in tiles, and its sine is a vector polynomial (about 1 ulp) instead of a library
call. It is several times faster than the torch form at BigVGAN-base's shapes (also when built for AVX2;
timings in docs/benchmarks/vocoders.md), as close to the float64 definition as the torch form
(1.3-1.9e-6 on unit-scale inputs). Taken where the torch form's numpy sine
is (a plain eager call on dense CPU float32 rows) and, in addition, at the exact length (`EXACT`: a
padded graph's `ValidLength` fix-ups stay torch's), 12-tap 2x filters and channels a multiple of 16;
anything else runs the torch form. Every value is computed by the same code whatever its position, so
stream == one-shot stays exact; the two forms differ by ~1e-6, so a process uses one per module.

Shape legend: B batch, C channels, T time steps at the block's own rate.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from time import perf_counter

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn.conv1d import ROWS
from flashrt.nn.reach import Reach
from flashrt.nn.valid import EXACT
from flashrt.ops import Form, Op, OpSlot, register

__all__ = ["Snake", "SnakeBeta", "kaiser_sinc_filter1d", "UpSample1d", "DownSample1d", "Activation1d",
           "SINES", "sin_", "pick_sine", "SNAKE_SINE", "AA_SNAKE"]

SINES = ("aten", "numpy")


# ----------------------------------------------------------------------------------------- sine

def _numpy_sine_applies(t: torch.Tensor) -> bool:
    """A plain eager call on a dense CPU float32 tensor (no autograd, no recording mode, no tracing)."""
    return (t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
            and (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)))
            and torch._C._len_torch_dispatch_stack() == 0 and not torch._C._is_torch_function_mode_enabled()
            and not torch.jit.is_tracing())


def sin_(t: torch.Tensor, sine: str = "aten") -> torch.Tensor:
    """t = sin(t) in place, by ATen or (``sine="numpy"``, where `_numpy_sine_applies`) by NumPy over t's
    memory as one flat array."""
    if sine != "numpy" or not _numpy_sine_applies(t):
        return t.sin_()
    flat = t.as_strided((t.numel(),), (1,)).numpy()
    np.sin(flat, out=flat)
    return t


@functools.cache
def pick_sine(probe: int = 1 << 18, tries: int = 5) -> str:
    """The faster sine of this process's CPU for float32: "numpy" where it beat ATen's by more than 20 %
    on a ``probe``-value tensor (best of ``tries`` each, interleaved), else "aten". Measured once."""
    x = torch.randn(probe, generator=torch.Generator().manual_seed(0)) * 4
    best = {"aten": math.inf, "numpy": math.inf}
    with torch.no_grad():
        for _ in range(tries):
            for name in SINES:
                t = x.clone()
                start = perf_counter()
                sin_(t, name)
                best[name] = min(best[name], perf_counter() - start)
    return "numpy" if best["numpy"] < 0.8 * best["aten"] else "aten"


def _aten_sin_(t: torch.Tensor) -> torch.Tensor:
    return t.sin_()


def _numpy_sin_(t: torch.Tensor) -> torch.Tensor:
    return sin_(t, "numpy")


# t = sin(t) in place: ATen's, or NumPy's where it measured faster on this CPU (float32)
SNAKE_SINE = register(Op("snake_sine", _aten_sin_, forms={
    "numpy": Form(_numpy_sin_, device="cpu", dtypes=(torch.float32,),
                  available=lambda: pick_sine() == "numpy")}))


# ----------------------------------------------------------------------------------------- snake

class Snake(nn.Module):
    """x + 1/(a + 1e-9) * sin(a x)^2 per channel; with ``logscale`` the stored alpha is log(a).

    (B, C, T) -> (B, C, T). ``alpha`` is (C,) as stored by BigVGAN/DAC-style checkpoints.
    """

    eps = 1e-9

    def __init__(self, channels: int, logscale: bool = True) -> None:
        super().__init__()
        self.sine = OpSlot(SNAKE_SINE)   # "aten" or "numpy": see the module docstring
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
        self.sine.run(t).square_()
        if t.requires_grad:  # autograd cannot record out=; inference never gets here
            return torch.addcmul(x, t, self.inv.view(shape))
        return torch.addcmul(x, t, self.inv.view(shape), out=t)   # one pass, into the fresh t


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
               valid=EXACT, pair: torch.Tensor | None = None) -> torch.Tensor:
    """y (zero-padded filter output) plus the replicate-padding contribution of x's first value and of
    its last real value (the end of the tensor, or where `valid` says the data ends).

    On rows at the exact length with ``pair`` (`_edge_pair`), both ends in one product and one add over
    a two-block view of y's ends: the same products and the same single add per sample as the two
    slices (zero gains add +0), ~6 fewer small ops per call (73 activations x 2 in BigVGAN)."""
    if pair is not None and valid is EXACT and x.dim() == 4 and y.shape[-1] >= 2 * pair.shape[-1]:
        n, (sb, sc, _, st) = pair.shape[-1], y.stride()
        ends = y.as_strided((y.shape[0], y.shape[1], 2, n), (sb, sc, (y.shape[-1] - n) * st, st))
        sb, sc, _, st = x.stride()
        edge = x.as_strided((x.shape[0], x.shape[1], 2, 1), (sb, sc, (x.shape[-1] - 1) * st, st))
        ends.add_(edge * pair)
        return y
    left, right = gains
    y[..., :left.numel()].add_(x[..., :1] * left)
    return valid.add_end(y, x, right)


def _edge_pair(gains: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """(2, n): the left gains at the start, the right gains at the end, zero-filled to one length n."""
    if gains is None:
        return None
    left, right = gains
    n = max(left.numel(), right.numel(), 1)
    return torch.stack([F.pad(left, (0, n - left.numel())), F.pad(right, (n - right.numel(), 0))])


def _cast_filters(module: nn.Module, dtype: torch.dtype) -> None:
    """Derived filters follow the dtype of the weights they run with (e.g. bf16 after a bf16 load)."""
    module.filter = module.filter.to(dtype)
    module.filter_rows = module.filter_rows.to(dtype).contiguous(memory_format=ROWS)
    if module.gains is not None:
        module.gains = tuple(g.to(dtype) for g in module.gains)
    module.edge_pair = _edge_pair(module.gains)


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
        self.edge_pair: torch.Tensor | None = None      # `_edge_pair(gains)`

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
        self.edge_pair = _edge_pair(self.gains)

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
        return _add_edges(x, y, self.gains, valid, self.edge_pair)

    def reach(self, rate: int = 1) -> Reach:
        """Bound on the reach, in frames, for an input at `rate` samples per frame."""
        half = Fraction(self.kernel_size, 2 * self.ratio)
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
        self.edge_pair: torch.Tensor | None = None      # `_edge_pair(gains)`

    def reset_derived(self) -> None:
        f = kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)
        self.filter = f.to(self.filter.dtype).expand(self.channels, 1, -1).contiguous()
        self.filter_rows = self.filter.unsqueeze(2).contiguous(memory_format=ROWS)
        f64 = f.double().view(1, 1, -1)
        gains = _edge_gains(lambda x: self._padded(x, f64),
                            lambda x: F.conv1d(x, f64, stride=self.ratio, padding=self.pad_left),
                            self.kernel_size)
        self.gains = None if gains is None else tuple(g.to(self.filter) for g in gains)
        self.edge_pair = _edge_pair(self.gains)

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
        return _add_edges(x, y, self.gains, valid, self.edge_pair)

    def reach(self, rate: int = 1) -> Reach:
        """`rate` is the samples-per-frame of the (high-rate) input."""
        return Reach(Fraction(self.kernel_size // 2, rate), Fraction(self.kernel_size // 2, rate))


class Activation1d(nn.Module):
    """Anti-aliased activation: upsample x2, pointwise activation, low-pass and downsample x2.

    (B, C, T) -> (B, C, T). ``act`` is a Snake/SnakeBeta (its parameters are ``act.alpha``/``act.beta``).
    ``aa_snake``: the slot of `AA_SNAKE`, "torch" (the three modules) or "native" (module docstring).
    """

    def __init__(self, channels: int, act: nn.Module, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        self.aa_snake = OpSlot(AA_SNAKE)
        self.act = act
        self.upsample = UpSample1d(channels, ratio, kernel_size)
        self.downsample = DownSample1d(channels, ratio, kernel_size)

    def reset_derived(self) -> None:
        """Runs after the resamplers' own (children first): their filters take the activation's dtype."""
        dtype = next(self.act.parameters()).dtype
        _cast_filters(self.upsample, dtype)
        _cast_filters(self.downsample, dtype)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        return self.aa_snake.run(self, x, valid)

    def reach(self, rate: int = 1) -> Reach:
        return self.upsample.reach(rate) + self.downsample.reach(rate * self.upsample.ratio)

    def _native_applies(self, x: torch.Tensor, valid) -> bool:
        """An exact-length plain eager call on dense channels-last CPU float32 rows, with the geometry
        the kernel is written for (2x, 12 taps, channels a multiple of 16)."""
        up, down = self.upsample, self.downsample
        return (valid is EXACT and x.dim() == 4 and _numpy_sine_applies(x) and x.shape[2] == 1
                and x.shape[1] % 16 == 0 and x.stride(1) == 1 and x.stride(3) == x.shape[1]
                and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.shape[3])
                and self.act.freq.dtype == torch.float32
                and up.ratio == down.ratio == 2 and up.kernel_size == down.kernel_size == 12)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        fn = _native_kernel()
        if fn is None:
            return self.downsample(self.act(self.upsample(x)))
        b, c, _, t = x.shape
        out = torch.empty_like(x, memory_format=ROWS)
        taps_up, taps_down = self.upsample.filter[0, 0], self.downsample.filter[0, 0]
        status = fn(x.data_ptr(), out.data_ptr(), b, t, c, taps_up.data_ptr(), taps_down.data_ptr(),
                    self.act.freq.data_ptr(), self.act.inv.data_ptr(), torch.get_num_threads())
        if status:
            raise RuntimeError(f"flashrt_aa_snake refused rows of shape {tuple(x.shape)} (status {status})")
        return out


def _native_kernel():
    """The C kernel's function, or None where the CPU library does not load."""
    from flashrt.ops import csrc_cpu

    lib = csrc_cpu.load()
    return None if lib is None else lib.handle.flashrt_aa_snake


def _torch_form(act: Activation1d, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
    return act.downsample(act.act(act.upsample(x, valid)), valid)


def _native_form(act: Activation1d, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
    """The C kernel where it takes the call (`Activation1d._native_applies`), the torch form elsewhere."""
    if act._native_applies(x, valid):
        return act._native(x)
    return _torch_form(act, x, valid)


# the anti-aliased snake (act, x, valid) -> y: the three modules, or one pass of the C kernel where the CPU
# library loads (`flashrt.ops.csrc_cpu.load`, which builds it on first use)
AA_SNAKE = register(Op("aa_snake", _torch_form, reference_name="torch", forms={
    "native": Form(_native_form, device="cpu", dtypes=(torch.float32,),
                   available=lambda: _native_kernel() is not None)}))
