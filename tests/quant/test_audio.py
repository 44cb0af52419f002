"""The speech-quality distances: zero for the same signal, growing with the distortion, refusing
signals that are not aligned, and blind to what lies below the reference's 60 dB range."""

import numpy as np
import pytest

from flashrt.quant.audio import log_spectral_distance, mel_cepstral_distortion

RATE = 22050


def _speechlike(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    """Harmonics of a gliding pitch under a syllable-rate envelope, plus faint noise."""
    g = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    f0 = 120 + 30 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 30))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.3 * envelope * voiced + 1e-3 * g.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("distance", [mel_cepstral_distortion, log_spectral_distance])
def test_zero_for_the_same_signal_and_growing_with_the_noise(distance):
    ref = _speechlike()
    g = np.random.default_rng(1)
    noise = g.standard_normal(ref.size).astype(np.float32) * ref.std()
    assert distance(ref, ref.copy(), RATE) == 0.0
    faint, loud = (distance(ref, ref + level * noise, RATE) for level in (10 ** (-40 / 20), 10 ** (-20 / 20)))
    assert 0 < faint < loud


@pytest.mark.parametrize("distance", [mel_cepstral_distortion, log_spectral_distance])
def test_signals_of_different_lengths_are_refused(distance):
    ref = _speechlike()
    with pytest.raises(ValueError, match="one length"):
        distance(ref, ref[:-1], RATE)


def test_what_lies_below_the_references_range_does_not_count():
    """Noise 100 dB below the signal sits under every frame's floor (its peak bin - 60 dB): no distance,
    where the same noise at -20 dB is a clear one. Without the floor such a faint floor in the bands the
    reference leaves empty would dominate both distances."""
    ref = _speechlike()
    noise = np.random.default_rng(2).standard_normal(ref.size).astype(np.float32) * ref.std()
    for distance in (mel_cepstral_distortion, log_spectral_distance):
        below = distance(ref, ref + 1e-5 * noise, RATE)
        assert below < 0.05 < distance(ref, ref + 0.1 * noise, RATE)
