"""Block-spectral 1-D convolution on CPU: a stride-1 conv as a DFT GEMM, one grouped 1x1 conv of the
frequency products, and an inverse DFT GEMM (overlap-save, real DFT by matmul).

Shape legend:
    B  batch
    C  input channels, O output channels
    T  time steps (input and output: 'same' padding)
    r  kernel taps, d dilation
    N  block size (DFT length, even); H = N - r + 1 outputs per block; F = N // 2 + 1 frequencies
    nb blocks per dilation phase; R = B * nb * d block rows
    P  spectra points (real rows per block); G groups of the products (`_forms`)

Why: a direct conv costs 2 r C O multiply-adds per output step. Cut the (dilation-phase) sequence into
overlapping blocks of N steps, take each block's real DFT, multiply per frequency by the kernel's DFT (a
complex C x O matrix) and transform back; the last H steps of each block are exact (overlap-save). Per
output step that is about 8 F C O / H for the products plus two small DFT GEMMs, e.g. for r = 11,
N = 64: about 3x fewer FLOPs than direct. Every stage is a GEMM on data in place (no FFT library, no
transposes of complex data): the forward DFT is one matmul of a (P, N) matrix with the overlapping
windows viewed in place, giving (R, P, C) spectra points; the products are one oneDNN grouped 1x1 conv
over those R rows (a real GEMM per frequency, channels-last: its pixels are the rows, no copies); the
inverse DFT is one (H, P) matmul. Two product forms (`points`): stacked, [re | im] (R, 2C) times the
real (2C, 2O) form of the complex kernel, where 2C <= 256; Gauss's three real products per frequency
(groups of C) at wider convs, where oneDNN's grouped kernels at 512 channels per group fall off a cliff.
Where torch's CPU kernels are not AVX-512 the same products run as one BLAS batched GEMM over the groups
(`grouped_products`): oneDNN's AVX2 grouped kernels fall off such cliffs at widths and lengths HiFi-GAN
uses (measured with oneDNN and MKL capped at AVX2: the grouped conv slower than the previous four-bmm
form over the whole V1, the batched GEMM faster; figures in docs/benchmarks/vocoders.md).
The result is the same function as ``F.conv1d``, and in fp32 closer to the float64 result than oneDNN's
direct conv (measured 2e-6 to 3e-6 vs 6e-6 to 1e-5 max |err| on unit-variance inputs).

Per conv at HiFi-GAN V1's lengths this form is faster than oneDNN's direct conv and than the previous
four-bmm spectral form at the kernels and widths `MEASURED_RULES` lists; the products run faster as one
grouped conv than as MKL bmm, and the DFT GEMMs faster in the native batched GEMM of csrc/spectral_cpu.c
(`_gemm`; where the CPU library builds: same sums) than as torch's batched matmul. The per-conv timings
are in docs/benchmarks/vocoders.md, "Measurements behind the code".
Kernels 3 and 5, and anything at 32 channels, are slower spectral (the transforms are not paid back);
so are short calls (fewer than `MIN_BLOCKS` block rows, where reading the products' weight dominates:
the plan runs the direct conv there). At short calls (cold caches, as inside the model) r 11 below 256
channels runs faster at N 32 than at N 64 and level at long ones, so it runs N 32 there.
`SpectralPolicy`'s rules encode that; `flashrt.nn.conv_policy` applies it. The price is memory: the
products' weights take 16 (F - 1) C O bytes per conv stacked, 4 (3 F - 4) C O Gauss (about twice and
1.5x the kernel spectrum): 174 MB over HiFi-GAN V1's 36 spectral convs (whose own weights are 56 MB),
73 MB more for the 12 short-call plans of its 256-channel convs (`SpectralPolicy.blocks`): 247 MB,
reported by `spectral_bytes` and `Vocoder.describe()`.

Layout: input and output are "rows" (B, C, 1, T) channels-last (`flashrt.nn.audio.to_rows`), i.e.
(B, T, C) in memory, the layout the rest of the vocoder runs in. CPU float32 only; anything else uses
the direct conv.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SpectralRule", "SpectralPolicy", "SpectralPlan", "MEASURED_RULES", "MIN_BLOCKS", "SHORT_BELOW",
           "SHORT_ROWS", "eligible", "fast_widths", "grouped_products", "points", "scratch_bytes",
           "spectral_bytes"]


_CONV = getattr(torch.ops.mkldnn, "_convolution_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None
_REORDER = getattr(torch.ops.mkldnn, "_reorder_convolution_weight", None) if _CONV is not None else None
_GROUP_WIDTHS = (128, 256)  # group widths (in and out) where oneDNN's packed grouped 1x1 conv measured fast
MIN_BLOCKS = 24             # fewer block rows R: the direct conv (the products' weight read is not paid back)


@dataclass(frozen=True)
class SpectralRule:
    """Convs with at least ``kernel`` taps and ``channels`` channels (in and out) go spectral; with
    ``undilated``, only when their dilation is 1 (the phase copies of a dilated one are not paid back);
    never above ``max_dilation`` (each dilation phase is a sequence of its own, padded to whole blocks:
    at Piper's d = 12, C 64-128, r 7, no faster than the direct conv; the rules were measured at
    HiFi-GAN V1's d <= 5)."""

    kernel: int
    channels: int
    undilated: bool = False
    max_dilation: int = 5

    def matches(self, kernel: int, channels: int, dilation: int) -> bool:
        dilated_ok = dilation == 1 or (not self.undilated and dilation <= self.max_dilation)
        return kernel >= self.kernel and channels >= self.channels and dilated_ok


MEASURED_RULES = (SpectralRule(7, 64),)
SHORT_BELOW = 64   # at >= 256 channels, calls of fewer block rows at the policy's N run at N = 2 (r - 1) ...
SHORT_ROWS = 40    # ... when they have at least this many rows there (`SpectralPolicy.blocks`)


@dataclass(frozen=True)
class SpectralPolicy:
    """Which convs run spectrally, and at what block size. ``None`` from `block` means direct.

    Default ``rules``: the measured break-even at 1 thread (module docstring): kernels >= 7 at >= 64
    channels, at channel counts whose products' groups oneDNN runs well (`fast_widths`: 64, 128, 256 in
    and out). N: the smallest power of two >= 2 (r - 1), at least 32 below 256 channels (the products'
    weight is read once per call: the wide convs, few rows per call, want it small; r 7 at C 64-128
    runs N 32 (N 16 is slower), r 11 there too: N 64 is slower on short calls and level on long ones,
    for twice the products' weight). A plan runs direct on calls of fewer than `min_blocks` blocks.
    `blocks` adds a second, smaller N for the short calls of the 256-channel convs. ``every`` forces the
    spectral path on every eligible conv (kernel >= 2) at every length, N being the smallest power of two
    >= 4 r, for tests and for comparing the two paths.
    """

    rules: tuple[SpectralRule, ...] = MEASURED_RULES
    every: bool = False

    def block(self, kernel: int, cin: int, cout: int, dilation: int = 1) -> int | None:
        channels = min(cin, cout)
        if self.every:
            return max(8, 1 << math.ceil(math.log2(4 * kernel))) if kernel >= 2 else None
        if not fast_widths(cin, cout):
            return None
        if not any(rule.matches(kernel, channels, dilation) for rule in self.rules):
            return None
        least = 1 << math.ceil(math.log2(2 * kernel - 2))
        return least if channels >= 256 else max(least, 32)

    @property
    def min_blocks(self) -> int:
        """Block rows below which a plan's call runs the direct conv (`SpectralPlan.min_blocks`)."""
        return 1 if self.every else MIN_BLOCKS

    def blocks(self, kernel: int, cin: int, cout: int, dilation: int = 1) -> tuple[tuple[int, int], ...]:
        """The plans a conv holds, as (N, min rows) pairs in order of preference: a call runs the first
        whose block rows reach its min rows, else the direct conv; () for a direct conv.

        One plan, (`block`, `min_blocks`), except at >= 256 channels: there (`block`, `SHORT_BELOW`) and
        (2 (r - 1), `SHORT_ROWS`). Those convs have few rows per call, and at few rows the products'
        weight read, not their FLOPs, sets the time: the least N (about 2/3 of the weight, ~1.4x the
        products' FLOPs per step) is faster up to ~60 rows at the larger N (per-conv and in-model
        timings in docs/benchmarks/vocoders.md, "Measurements behind the code").
        `SHORT_ROWS` keeps the short plan from calls shorter than the policy's N engages today (r 7: T
        240) but lets r 11 run it from T 400 (V1's 50-frame call, 19 rows at N 32). Memory: the short
        plans' weights, 4 (3 F - 4) C O bytes each (4.5 MB at r 7, 7.6 MB at r 11; V1 +73 MB).
        """
        block = self.block(kernel, cin, cout, dilation)
        if block is None:
            return ()
        short = 2 * (kernel - 1)
        if self.every or min(cin, cout) < 256 or short >= block:
            return ((block, self.min_blocks),)
        return ((block, SHORT_BELOW), (short, SHORT_ROWS))


def _dft_matrices(n: int, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 real and imaginary parts of the forward DFT, (F, N) each, and of the real inverse DFT at
    steps [first, N), (N - first, F) each (DC and Nyquist weighted once, the other bins twice)."""
    f = torch.arange(n // 2 + 1, dtype=torch.float64)
    steps = torch.arange(n, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(f, steps) / n                          # (F, N)
    weight = torch.full_like(f, 2.0 / n)
    weight[0] = weight[-1] = 1.0 / n
    back = angle.T[first:]                                                   # (H, F)
    return torch.cos(angle), -torch.sin(angle), torch.cos(back) * weight, -torch.sin(back) * weight


def points(in_ch: int) -> int:
    """Real products per frequency (m): 2, the stacked form, where its groups of 2 C channels are a
    width oneDNN runs well (C <= 128); else 3, Gauss's form (groups of C channels)."""
    return 2 if 2 * in_ch <= max(_GROUP_WIDTHS) else 3


def _widths(in_ch: int, out_ch: int) -> tuple[int, int]:
    """The channels of one group of the products' grouped conv, in and out (2 C, 2 O stacked; C, O Gauss)."""
    wide = 2 if points(in_ch) == 2 else 1
    return wide * in_ch, wide * out_ch


def _forms(spectrum: torch.Tensor, m: int, dft: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward (P, N) and inverse (H, P) matrices of the P spectra points, and the products' grouped
    1x1 conv weight (G w O, w C, 1, 1) (G groups of width w C), for kernel spectrum (F, C, O) complex and
    `_dft_matrices` ``dft``. The DC and Nyquist bins are real (N even): one real product each.

    m = 2 (stacked, w = 2; G = F - 1): group f maps [re | im] of X_f to [re | im] of X_f W_f by one
    real (2C, 2O) matrix [[Wr, Wi], [-Wi, Wr]]; DC and Nyquist share the first group, by
    diag(W_0, W_N/2). 4 (F - 1) C O numbers, about twice the spectrum's.
    m = 3 (Gauss, w = 1; G = 3 F - 4): points s = re + im, re, im times Wr, Wi - Wr, Wr + Wi, then
    re = k0 - k2, im = k0 + k1; DC and Nyquist one group each. 3/4 of the stacked form's numbers and FLOPs.
    """
    fre, fim, ire, iim = dft
    wr, wi = spectrum.real.transpose(1, 2), spectrum.imag.transpose(1, 2)   # (F, O, C)
    ends, inner = [0, -1], slice(1, -1)
    if m == 2:
        forward, inverse = torch.stack([fre, fim], 1), torch.stack([ire, iim], 2)
        kernel = torch.cat([torch.cat([wr, -wi], 2), torch.cat([wi, wr], 2)], 1)        # (F, 2O, 2C)
        real = torch.block_diag(wr[0], wr[-1]).unsqueeze(0)                              # (1, 2O, 2C)
    else:
        forward, inverse = torch.stack([fre + fim, fre, fim], 1), torch.stack([ire + iim, iim, -ire], 2)
        kernel = torch.stack([wr, wi - wr, wr + wi], 1).flatten(1, 2)                   # (F, 3O, C)
        real = wr[ends]                                                                  # (2, O, C)
    forward = torch.cat([fre[ends], forward[inner].flatten(0, 1)])
    inverse = torch.cat([ire[:, ends], inverse[:, inner].flatten(1, 2)], 1)
    kernel = torch.cat([real.flatten(0, 1), kernel[inner].flatten(0, 1)])
    return forward.float(), inverse.float(), kernel.unsqueeze(2).unsqueeze(3).float().contiguous()


@functools.cache
def grouped_products() -> bool:
    """Whether the products run as oneDNN's grouped 1x1 conv (else one BLAS batched GEMM, `_batched`):
    where torch's CPU kernels run AVX-512, where it measured faster than the batched GEMM. With AVX2
    kernels (oneDNN capped at AVX2) the grouped conv falls off a cliff at some (group width, rows)
    pairs, slower than the direct conv, while the batched GEMM has none (figures in
    docs/benchmarks/vocoders.md, "Measurements behind the code")."""
    return _REORDER is not None and torch.backends.cpu.get_cpu_capability() == "AVX512"


def fast_widths(in_ch: int, out_ch: int) -> bool:
    """Whether the products' grouped conv runs at widths oneDNN was measured fast at. At others (192 and
    512 measured) its packed weight fits some lengths only; at the rest a call is many times slower."""
    return all(width in _GROUP_WIDTHS for width in _widths(in_ch, out_ch))


class SpectralPlan(nn.Module):
    """One conv's block-spectral form (derived from its weight; rebuilt when the weight changes).

    weight (O, C, r) float32 on the CPU, ``dilation`` d, ``padding`` the left zero padding (right: the
    rest of the span, output length = input length), ``block`` N >= 2 r - 2 (so a hop H = N - r + 1
    covers the r - 1 steps of overlap; `_windows` relies on it), ``bias`` (O,) or None: folded once into
    the products' DC point (N x bias there is + bias at every step after the inverse DFT). Calls of
    fewer than `min_blocks` block rows are the owner's to run direct (`engages`; `flashrt.nn.audio.Conv1d`
    does, with its packed weight and fused epilogue).

    ``halo``: in a padded call (`flashrt.nn.valid.ValidLength`) the steps past the valid end that a valid
    output's rounding depends on: every input of its block, up to d N steps past the end, not only
    the r - 1 taps the conv reaches (the DFT mixes the whole block; what lies beyond the taps cancels
    only to float rounding). The owner zeroes them before the call, so a valid output never depends on
    what an earlier call left in the padding.
    """

    def __init__(self, weight: torch.Tensor, dilation: int, padding: int, block: int,
                 bias: torch.Tensor | None = None, min_blocks: int = MIN_BLOCKS) -> None:
        super().__init__()
        out_ch, in_ch, taps = weight.shape
        if block < 2 * taps - 2 or block % 2 or 2 * padding != dilation * (taps - 1):
            raise ValueError(f"spectral conv needs 'same' padding and an even block ({block}) of at least "
                             f"twice the kernel ({taps} taps, dilation {dilation}, padding {padding})")
        self.taps, self.dilation, self.padding, self.block = taps, dilation, padding, block
        self.hop = block - taps + 1
        self.min_blocks = min_blocks
        self.halo = dilation * block   # padding steps past the valid end a valid output's block reads
        self.out_ch, self.points = out_ch, points(in_ch)
        kernel = weight.detach().double().flip(-1).permute(2, 1, 0)              # (r, C, O), reversed taps
        spectrum = torch.fft.rfft(kernel, n=block, dim=0)                        # (F, C, O)
        dft, idft, products = _forms(spectrum, self.points, _dft_matrices(block, taps - 1))
        self.groups = products.shape[0] // _widths(in_ch, out_ch)[1]    # F - 1 (stacked), 3 F - 4 (Gauss)
        self.register_buffer("dft", dft, persistent=False)                       # (P, N)
        self.register_buffer("idft", idft, persistent=False)                     # (H, P)
        self.packed = _pack(products, self.groups) if grouped_products() else None  # oneDNN's layout
        plain = products.view(self.groups, -1, products.shape[1]).transpose(1, 2).contiguous()
        self.register_buffer("kernel", plain if self.packed is None else products.new_empty(0),
                             persistent=False)                                   # else (G, w C, w O)
        _native_gemm()                                     # build the CPU library now (load), not at a call
        dc = None if bias is None else torch.cat([bias.detach().float() * float(block),
                                                  bias.new_zeros((dft.shape[0] - 1) * out_ch)])
        self.register_buffer("point_bias", dc, persistent=False)                # (P O,): N bias at DC

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x rows (B, C, 1, T) channels-last -> rows (B, O, 1, T) channels-last (conv + bias); inference
        only."""
        b, c, _, t = x.shape
        nb = math.ceil(math.ceil(t / self.dilation) / self.hop)
        seq = x.permute(0, 2, 3, 1).reshape(b, t, c)                             # (B, T, C), no copy
        scratch = _Scratch.active(x)
        padded = self._padded(seq, (nb * self.hop + self.taps - 1) * self.dilation, scratch)
        windows, per = self._windows(padded, nb, scratch)                        # (R, N, C)
        spectra = scratch.take("spectra", (windows.shape[0], self.dft.shape[0], c), x)
        prod = self._products(_gemm(self.dft, windows, spectra, scratch.keep))  # (R, P, O)
        out = self._inverse(prod, b, nb, per, scratch.keep)                      # (B, >= T, O)
        rows = out[:, :t].permute(0, 2, 1).unsqueeze(2)
        return rows if b == 1 else rows.contiguous(memory_format=torch.channels_last)

    def engages(self, x: torch.Tensor) -> bool:
        """Whether a call on rows x (B, C, 1, T) runs spectrally: at least `min_blocks` block rows."""
        b, t = x.shape[0], x.shape[-1]
        nb = math.ceil(math.ceil(t / self.dilation) / self.hop)
        return b * self.dilation * (nb if b * self.dilation == 1 else nb + 1) >= self.min_blocks

    def _padded(self, seq: torch.Tensor, steps: int, scratch: _Scratch) -> torch.Tensor:
        """(B, T, C) -> (B, steps, C): `padding` zeros, the sequence, zeros (only the pads are zeroed)."""
        b, t, c = seq.shape
        out = scratch.take("padded", (b, steps, c), seq)
        out[:, :self.padding].zero_()
        out[:, self.padding + t:].zero_()
        out[:, self.padding:self.padding + t].copy_(seq)
        return out

    def _windows(self, padded: torch.Tensor, nb: int, scratch: _Scratch) -> tuple[torch.Tensor, int]:
        """The overlapping blocks as one strided (R, N, C) batch, R = B * d * per, and `per`, the blocks
        per (batch row, dilation phase). With one sequence (B = d = 1) they are read in place (per = nb);
        otherwise each phase is copied out to a stretch of `per` = nb + 1 hops, so one stride walks every
        block of every phase (the last block of each stretch is filler; its rows are dropped)."""
        b, steps, c = padded.shape
        d, hop, n = self.dilation, self.hop, self.block
        if b * d == 1:
            return padded.as_strided((nb, n, c), (hop * c, c, 1)), nb
        per, length = nb + 1, steps // d
        flat = scratch.take("phases", (b * d * per * hop + n, c), padded)
        phases = flat[:b * d * per * hop].view(b, d, per * hop, c)
        phases[:, :, :length].copy_(padded.view(b, length, d, c).transpose(1, 2))
        phases[:, :, length:].zero_()
        flat[b * d * per * hop:].zero_()
        return flat.as_strided((b * d * per, n, c), (hop * c, c, 1)), per

    def _products(self, spec: torch.Tensor) -> torch.Tensor:
        """(R, P, C) spectra points -> (R, P, O) (+ `point_bias`): per group, (R, w C) @ (w C, w O), as one
        grouped 1x1 conv over the R blocks (channels-last: the (R, P C) rows are its pixels, no copies)."""
        rows = spec.shape[0]
        if self.packed is None:
            return self._batched(spec)
        image = spec.view(1, rows, 1, -1).permute(0, 3, 1, 2)                    # (1, P C, R, 1)
        y = _CONV(image, self.packed, self.point_bias, [0, 0], [1, 1], [1, 1], self.groups, "none", [], "")
        return y.permute(0, 2, 3, 1).reshape(rows, -1, self.out_ch)

    def _batched(self, spec: torch.Tensor) -> torch.Tensor:
        """The same products as one batched GEMM over the G groups (BLAS), read and written in place:
        (G, R, w C) strided views of the spectra times (G, w C, w O) into the (R, P, O) rows."""
        rows, groups = spec.shape[0], self.groups
        out = spec.new_empty(rows, spec.shape[1], self.out_ch)
        torch.bmm(spec.view(rows, groups, -1).transpose(0, 1), self.kernel,
                  out=out.view(rows, groups, -1).transpose(0, 1))
        if self.point_bias is not None:
            out[:, 0].add_(self.point_bias[:self.out_ch])                        # the DC point
        return out

    def _inverse(self, prod: torch.Tensor, b: int, nb: int, per: int, native: bool) -> torch.Tensor:
        """(R, P, O) products -> (B, >= nb * H * d, O) time steps (the valid end of each block)."""
        d, hop, o = self.dilation, self.hop, self.out_ch
        y = prod.new_empty(prod.shape[0], hop, o)                               # (R, H, O)
        _gemm(self.idft, prod, y, native)
        if d == 1:                                         # each row's blocks are contiguous in time
            return y.view(b, per * hop, o)
        out = prod.new_empty(b, nb, hop, d, o)
        out.copy_(y.view(b, d, per, hop, o)[:, :, :nb].permute(0, 2, 3, 1, 4))
        return out.view(b, nb * hop * d, o)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, native: bool) -> torch.Tensor:
    """out (R, M, N) = a (M, K) @ b (R, K, N), b a strided view with unit stride along N: with ``native``
    (a plain eager call) by csrc/spectral_cpu.c's batched GEMM where the CPU library loads (1.5-2.3x
    torch's batched matmul at the DFTs' shapes on the dev CPU; the same sums in the same k order,
    bit-identical there), else ``torch.matmul(a, b, out=out)``."""
    fn = _native_gemm() if native else None
    if fn is None or b.stride(2) != 1 or b.shape[2] % 16 or not a.is_contiguous() or not out.is_contiguous():
        return torch.matmul(a, b, out=out)
    rows, k, n = b.shape
    m = a.shape[0]
    status = fn(a.data_ptr(), 0, k, m, k, b.data_ptr(), b.stride(0), b.stride(1), rows, n, out.data_ptr(),
                m * n, n, torch.get_num_threads())
    if status:
        raise RuntimeError(f"flashrt_bgemm refused {tuple(a.shape)} x {tuple(b.shape)} (status {status})")
    return out


def _native_gemm():
    """csrc/spectral_cpu.c's batched GEMM, or None where the CPU library does not load (built on the
    first call, at the first plan's construction: load time)."""
    from flashrt.ops import csrc_cpu

    lib = csrc_cpu.load()
    return None if lib is None else lib.handle.flashrt_bgemm


class _Scratch:
    """Per-thread buffers a plan's call reuses for its temporaries (the padded sequence, the dilation
    phases, the spectra), grown to the largest call and kept. Why: at HiFi-GAN V1's 512-frame lengths
    those are 17-25 MB each; fresh, glibc maps and unmaps them (or trims its heap) on every call, and the
    call faults its pages in again: 120-156k minor faults, 10-14 % of its CPU time. Only in plain eager
    calls (`active`): under a recording mode (the trace backend, FLOP counters, export) every temporary
    stays a fresh tensor. A plan's output is always fresh (its caller keeps it). `WinogradPlan` keeps
    its transformed rows here too. Memory: the largest temporary of each role on the thread (HiFi-GAN
    V1 at 512 frames: ~60 MB per thread; `scratch_bytes`)."""

    _local = threading.local()

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    @classmethod
    def active(cls, x: torch.Tensor) -> _Scratch:
        """Reusing buffers for a plain eager call (no dispatch or function mode, no tracing); else fresh."""
        plain = torch._C._len_torch_dispatch_stack() == 0 and not torch._C._is_torch_function_mode_enabled() \
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling() and not x.requires_grad
        return _KEEP if plain else _FRESH

    def take(self, role: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised (shape) tensor of ``like``'s dtype and device: a view of this thread's
        ``role`` buffer (grown when too small; one per role inside and outside `torch.inference_mode`,
        whose tensors cannot be written outside it), or a fresh tensor."""
        if not self.keep:
            return like.new_empty(shape)
        held = getattr(self._local, "buffers", None)
        if held is None:
            held = self._local.buffers = {}
        need = math.prod(shape)
        key = (role, torch.is_inference_mode_enabled())  # an inference tensor is not writable outside
        buf = held.get(key)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            buf = held[key] = like.new_empty(need)
        return buf[:need].view(shape)


_KEEP, _FRESH = _Scratch(True), _Scratch(False)


def scratch_bytes() -> int:
    """Bytes this thread's spectral scratch buffers hold (`_Scratch`)."""
    held = getattr(_Scratch._local, "buffers", {})
    return sum(b.numel() * b.element_size() for b in held.values())


def _pack(kernel: torch.Tensor, groups: int) -> torch.Tensor:
    """The products' conv weight reordered once into oneDNN's blocked layout (a plain weight is
    reordered on every call: twice the products' time at C = 256)."""
    return _REORDER(kernel, [0, 0], [1, 1], [1, 1], groups, [1, kernel.shape[1] * groups, 64, 1])


def eligible(conv: nn.Module) -> bool:
    """Stride 1, no groups, 'same' output length (odd span), float32 on the CPU."""
    same = 2 * conv.padding[0] == conv.dilation[0] * (conv.kernel_size[0] - 1)
    return conv.groups == 1 and conv.stride[0] == 1 and same and conv.weight.dtype == torch.float32 \
        and conv.weight.device.type == "cpu"


def spectral_bytes(module: nn.Module) -> int:
    """Bytes held by the spectral plans in ``module`` (product weights, packed or plain, and DFT matrices)."""
    plans = [plan for plan in module.modules() if isinstance(plan, SpectralPlan)]
    held = [buf for plan in plans for buf in plan.buffers()]
    held += [plan.packed for plan in plans if plan.packed is not None]
    return sum(t.numel() * t.element_size() for t in held)
