"""load_vocoder with a hostile file in every place one is read (config.json, config.yaml, the weight file,
a model card): a typed error under a memory limit and a timeout (flashrt.testing.hostile), never a hang
(a FIFO used to hang load_vocoder) or unbounded memory (/dev/zero)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flashrt.errors import FlashRTError
from flashrt.runner.vocoder import load_vocoder
from flashrt.testing.hostile import bounded_call, make_hostile

pytestmark = pytest.mark.timeout(180)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vocoders"
KINDS = ("dev-zero", "fifo", "directory")

PLACES = {  # (fixture folder, file replaced)
    "hifigan config.json": ("hifigan_v1_tiny", "config.json"),
    "hifigan generator.pt": ("hifigan_v1_tiny", "generator.pt"),
    "bigvgan bigvgan_generator.pt": ("bigvgan_tiny_plain", "bigvgan_generator.pt"),
    "vocos config.yaml": ("vocos_mel_tiny", "config.yaml"),
    "vocos pytorch_model.bin": ("vocos_mel_tiny", "pytorch_model.bin"),
    "snac config.json": ("snac_24khz_tiny", "config.json"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("place", PLACES)
def test_hostile_file_in_a_vocoder_folder(tmp_path, place, kind):
    name, file = PLACES[place]
    folder = shutil.copytree(FIXTURES / name, tmp_path / name)
    path = folder / file
    path.unlink()
    make_hostile(path, kind)
    exc = bounded_call(lambda: load_vocoder(folder, buckets=(8,)), timeout_s=20.0, fifos=[path])
    assert isinstance(exc, FlashRTError), repr(exc)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_weight_file_given_directly(tmp_path, kind):
    path = make_hostile(tmp_path / "generator.pt", kind)
    exc = bounded_call(lambda: load_vocoder(path, family="hifigan"), timeout_s=20.0, fifos=[path])
    assert isinstance(exc, FlashRTError), repr(exc)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_model_card(tmp_path, kind):
    path = make_hostile(tmp_path / "card.toml", kind)
    exc = bounded_call(lambda: load_vocoder(path, checkpoint=FIXTURES / "hifigan_v1_tiny"), timeout_s=5.0,
                       fifos=[path])
    assert isinstance(exc, FlashRTError), repr(exc)
