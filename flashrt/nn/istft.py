"""Inverse STFT synthesis with Vocos' "center" and "same" padding, and the ISTFT head that feeds it.

Shape legend:
    B batch, T frames, N n_fft (frame length), F = N // 2 + 1 frequency bins, H hop, D model width,
    R = N // H frames overlapping each output sample, L output samples.

Output length: "center" gives (T - 1) * H samples (what ``torch.istft(center=True)`` gives), "same"
gives T * H (the frames are trimmed by (N - H) / 2 on each side, like a "same" convolution).

Padded graphs: with a `flashrt.nn.audio.ValidLength`, frames past the valid length are zeroed and the
envelope is the overlap-add of the squared window over the valid frames only (computed in the graph),
so the first ``output_length(valid frames)`` samples equal an unpadded run.

Everything is plain torch ops on static shapes, so it can be captured as a graph: the window is a
non-persistent buffer, the inverse window envelope is computed once per frame count and cached (the
first call at a new T computes it with torch ops, which a warm-up run does before capture), and the
overlap-add is R shifted in-place adds instead of ``F.fold`` (much faster on CPU for N = 4H).
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn.convnext import FusedLinear
from flashrt.nn.reach import Reach
from flashrt.nn.valid import EXACT

__all__ = ["PADDINGS", "ISTFT", "ISTFTHead", "hann_window", "overlap_add"]

PADDINGS = ("center", "same")
_ENVELOPE_FLOOR = 1e-11  # torch.istft's NOLA threshold; below it the frames cannot be inverted
_MAX_MAGNITUDE = 1e2  # Vocos clips exp(log-magnitude) here


def hann_window(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Periodic Hann window of length n (``torch.hann_window`` default), float32."""
    return torch.hann_window(n, periodic=True, dtype=torch.float32, device=device)


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """Sum frames (B, T, N) placed every ``hop`` samples: (B, (T - 1) * hop + N)."""
    b, t, n = frames.shape
    if n % hop:
        full = (t - 1) * hop + n
        return F.fold(frames.transpose(1, 2), (1, full), (1, n), stride=(1, hop)).reshape(b, full)
    r = n // hop
    out = frames.new_zeros(b, t + r - 1, hop)
    parts = frames.reshape(b, t, r, hop)
    for i in range(r):
        out[:, i:i + t].add_(parts[:, :, i])
    return out.reshape(b, (t + r - 1) * hop)


class ISTFT(nn.Module):
    """Complex spectrum frames (B, T, F) -> audio (B, L); window = periodic Hann of length N."""

    def __init__(self, n_fft: int, hop: int, padding: str = "center") -> None:
        super().__init__()
        if padding not in PADDINGS:
            raise ValueError(f"ISTFT padding must be one of {PADDINGS}, got {padding!r}")
        if not 0 < hop <= n_fft:
            raise ValueError(f"ISTFT hop must be in 1..n_fft={n_fft}, got {hop}")
        self.n_fft, self.hop, self.padding = n_fft, hop, padding
        self.register_buffer("window", torch.empty(n_fft), persistent=False)
        self._inv_envelope: dict[tuple, torch.Tensor] = {}
        self.reset_derived()

    def reset_derived(self) -> None:
        """(Re)compute the window on the current default device; drop cached envelopes."""
        device = None if self.window.is_meta else self.window.device
        self.window = hann_window(self.n_fft, device=device)
        self._inv_envelope = {}

    @property
    def trim(self) -> int:
        """Samples cut from each end of the overlap-added signal."""
        return self.n_fft // 2 if self.padding == "center" else (self.n_fft - self.hop) // 2

    def output_length(self, frames: int) -> int:
        return (frames - 1) * self.hop + self.n_fft - 2 * self.trim

    def inverse_envelope(self, frames: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """1 / (sum of squared windows) over the kept samples, (L,); cached per frame count."""
        key = (frames, device, dtype)
        if key not in self._inv_envelope:
            sq = self.window.to(device=device, dtype=dtype).square().expand(1, frames, self.n_fft)
            env = overlap_add(sq, self.hop)[0, self.trim:self.trim + self.output_length(frames)]
            self._inv_envelope[key] = torch.where(env > _ENVELOPE_FLOOR, env.reciprocal(), 0.0)
        return self._inv_envelope[key]

    def masked_inverse_envelope(self, mask: torch.Tensor) -> torch.Tensor:
        """1 / envelope of the frames with mask (T,) = 1, over the kept samples (L,); graph-safe."""
        sq = self.window.to(mask.dtype).square()[None, None, :] * mask[None, :, None]  # (1, T, N)
        env = overlap_add(sq, self.hop)[0, self.trim:self.trim + self.output_length(mask.shape[0])]
        return torch.where(env > _ENVELOPE_FLOOR, env.reciprocal(), 0.0)

    def reach(self, rate: int = 1) -> Reach:
        """Frames an output sample depends on: the overlapping frames of n_fft samples, `hop` apart (one
        input frame per `rate` spectral frames)."""
        per_frame = self.hop * rate
        return Reach(Fraction(self.n_fft - 1 - self.trim, per_frame), Fraction(self.trim, per_frame))

    def forward(self, spec: torch.Tensor, valid=EXACT) -> torch.Tensor:
        """spec: complex (B, T, F) -> audio (B, L).

        With a padded ``valid`` (`flashrt.nn.audio.ValidLength`), frames past the valid length are
        dropped (zeroed, and left out of the envelope), so the kept samples equal an unpadded run.
        """
        t = spec.shape[1]
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=-1) * self.window  # (B, T, N)
        if valid is EXACT:
            inv = self.inverse_envelope(t, frames.device, frames.dtype)
        else:
            mask = valid.zero(torch.ones(t, device=frames.device, dtype=frames.dtype))  # (T,)
            frames = frames * mask[:, None]
            inv = self.masked_inverse_envelope(mask)
        full = overlap_add(frames, self.hop)
        return full[:, self.trim:self.trim + self.output_length(t)] * inv


class ISTFTHead(nn.Module):
    """Vocos head: Linear to log-magnitude | phase, then ISTFT.  x (B, T, D) -> audio (B, L).

    ``out`` has N + 2 outputs: the first F are log-magnitudes (exp, clipped at 100), the last F phases.
    """

    def __init__(self, dim: int, n_fft: int, hop: int, padding: str = "center") -> None:
        super().__init__()
        self.bins = n_fft // 2 + 1
        self.out = FusedLinear(dim, 2 * self.bins)
        self.istft = ISTFT(n_fft, hop, padding)

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> complex spectrum (B, T, F), computed in float32."""
        y = self.out(x).float()
        mag = y[..., :self.bins].exp().clamp_(max=_MAX_MAGNITUDE)
        phase = y[..., self.bins:]
        return torch.complex(mag * phase.cos(), mag * phase.sin())

    def reach(self, rate: int = 1) -> Reach:
        return self.istft.reach(rate)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        return self.istft(self.spectrum(x), valid)
