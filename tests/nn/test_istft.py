"""ISTFT with "center"/"same" padding, overlap-add, the Vocos head, and padded (ValidLength) runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrt.io import build_on_meta, reset_derived
from flashrt.nn.audio import ValidLength
from flashrt.nn.istft import ISTFT, ISTFTHead, hann_window, overlap_add

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(batch: int, frames: int, n_fft: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bins = n_fft // 2 + 1
    re, im = (torch.randn(batch, frames, bins, generator=g) for _ in range(2))
    return torch.complex(re, im)


def _naive_istft(spec: torch.Tensor, n_fft: int, hop: int, trim: int) -> torch.Tensor:
    """Per-frame inverse DFT + windowed overlap-add + envelope, in float64 loops (independent check)."""
    b, t, _ = spec.shape
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    full = (t - 1) * hop + n_fft
    out = torch.zeros(b, full, dtype=torch.float64)
    env = torch.zeros(full, dtype=torch.float64)
    for k in range(t):
        frame = torch.fft.irfft(spec[:, k].to(torch.complex128), n=n_fft)
        out[:, k * hop:k * hop + n_fft] += frame * window
        env[k * hop:k * hop + n_fft] += window ** 2
    return (out / env)[:, trim:full - trim]


@pytest.mark.parametrize("n_fft,hop,frames", [(256, 64, 20), (64, 16, 2), (160, 40, 9)])
def test_center_equals_torch_istft(n_fft, hop, frames):
    spec = _spec(2, frames, n_fft)
    ours = ISTFT(n_fft, hop, "center")(spec)
    ref = torch.istft(spec.transpose(1, 2), n_fft, hop, n_fft, torch.hann_window(n_fft), center=True)
    assert ours.shape == ref.shape == (2, (frames - 1) * hop)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_fft,hop,frames", [(160, 40, 12), (64, 16, 3), (96, 32, 5)])
def test_same_equals_naive_overlap_add(n_fft, hop, frames):
    spec = _spec(2, frames, n_fft, seed=1)
    ours = ISTFT(n_fft, hop, "same")(spec)
    ref = _naive_istft(spec, n_fft, hop, (n_fft - hop) // 2).float()
    assert ours.shape == ref.shape == (2, frames * hop)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_bad_padding_and_hop_are_refused():
    with pytest.raises(ValueError, match="padding"):
        ISTFT(64, 16, "valid")
    with pytest.raises(ValueError, match="hop"):
        ISTFT(64, 0)


@pytest.mark.parametrize("n,hop", [(64, 16), (60, 16), (64, 64)])
def test_overlap_add_matches_fold(n, hop):
    frames = torch.randn(3, 7, n)
    full = 6 * hop + n
    ref = F.fold(frames.transpose(1, 2), (1, full), (1, n), stride=(1, hop)).reshape(3, full)
    torch.testing.assert_close(overlap_add(frames, hop), ref)


@pytest.mark.parametrize("padding", ["center", "same"])
def test_padded_frames_with_valid_length_equal_unpadded_run(padding):
    istft = ISTFT(128, 32, padding)
    spec = _spec(1, 9, 128, seed=2)
    garbage = _spec(1, 7, 128, seed=3) * 50
    padded = torch.cat([spec, garbage], dim=1)
    out = istft(padded, ValidLength(torch.tensor([9]), 16))
    ref = istft(spec)
    torch.testing.assert_close(out[:, :ref.shape[1]], ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(istft(padded)[:, :ref.shape[1]], ref, atol=1e-3)  # the mask matters


def test_envelope_is_cached_per_frame_count():
    istft = ISTFT(64, 16)
    a = istft.inverse_envelope(5, torch.device("cpu"), torch.float32)
    assert istft.inverse_envelope(5, torch.device("cpu"), torch.float32) is a
    assert istft.inverse_envelope(6, torch.device("cpu"), torch.float32).shape == (istft.output_length(6),)


def test_window_is_derived_on_the_load_device():
    module = build_on_meta(lambda: ISTFT(64, 16))
    assert module.window.is_meta
    reset_derived(module, "cpu")
    torch.testing.assert_close(module.window, hann_window(64))
    torch.testing.assert_close(hann_window(64), torch.hann_window(64))


def test_head_clips_magnitude_and_matches_explicit_formula():
    head = ISTFTHead(8, 32, 8, "center")
    torch.manual_seed(0)
    with torch.no_grad():
        head.out.weight.normal_()
        head.out.bias.normal_()
        head.out.bias[:17] += 10.0  # exp() far above the 1e2 clip for some bins
    head.out.reset_derived()
    x = torch.randn(2, 6, 8)
    y = x @ head.out.weight.T + head.out.bias
    mag = torch.clip(torch.exp(y[..., :17]), max=1e2)
    spec = mag * (torch.cos(y[..., 17:]) + 1j * torch.sin(y[..., 17:]))
    ref = torch.istft(spec.transpose(1, 2), 32, 8, 32, torch.hann_window(32), center=True)
    torch.testing.assert_close(head(x), ref, atol=1e-4, rtol=1e-5)
    assert float(head.spectrum(x).detach().abs().max()) <= 100.0 + 1e-3
