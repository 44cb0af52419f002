"""Untrusted Orpheus-style checkpoint files (#28.5, #28.8): the layout file (orpheus.json), the text
tokenizer and the LM's config.json are read as regular, size-capped files and checked field by field:
a FIFO, a link to /dev/zero, a corrupt or oversized file, a wrong-typed field is a CheckpointError
naming the file (and the field), at load, never a hang, unbounded memory or a raw library error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError
from flashrt.frontends.lm.config import LMConfig
from flashrt.frontends.lm.frontend import read_config
from flashrt.frontends.orpheus.layout import OrpheusLayout, load_text_tokenizer, read_layout
from flashrt.testing.hostile import bounded_call, make_hostile

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tts" / "orpheus_tiny"
TOKENIZER = OrpheusLayout(text_tokenizer="tokenizer.json")


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "orpheus"))


def _refused(fn, path: Path, *words: str) -> str:
    exc = bounded_call(fn, timeout_s=20.0, fifos=[path])
    assert isinstance(exc, CheckpointError), repr(exc)
    assert str(path) in str(exc) and all(w in str(exc) for w in words), str(exc)
    return str(exc)


# ---------------------------------------------------------------------------------- orpheus.json

@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device"),
                                        ("directory", "directory")])
def test_a_layout_file_that_is_not_a_regular_file_is_refused_not_ignored(tmp_path, kind, word):
    folder = _copy(tmp_path)
    (folder / "orpheus.json").unlink()
    path = make_hostile(folder / "orpheus.json", kind)
    _refused(lambda: read_layout(folder, 64), path, word)


def test_a_corrupt_layout_file_names_it(tmp_path):
    folder = _copy(tmp_path)
    (folder / "orpheus.json").write_bytes(b"{\"base_vocab\": 2")
    _refused(lambda: read_layout(folder, 64), folder / "orpheus.json", "not valid JSON")


LAYOUT_CASES = {
    "base_vocab a string": ({"base_vocab": "258"}, "base_vocab"),
    "base_vocab zero": ({"base_vocab": 0}, "base_vocab"),
    "bos a bool": ({"bos_token_id": True}, "bos_token_id"),
    "bos negative": ({"bos_token_id": -1}, "bos_token_id"),
    "eot at base_vocab": ({"eot_token_id": 258}, "eot_token_id"),
    "codebook a float": ({"codebook_size": 64.0}, "codebook_size"),
    "text_tokenizer a number": ({"text_tokenizer": 5}, "text_tokenizer"),
    "text_tokenizer empty": ({"text_tokenizer": " "}, "text_tokenizer"),
    "unknown key": ({"voices": ["tara"]}, "unknown key"),
}


@pytest.mark.parametrize("change, field", LAYOUT_CASES.values(), ids=list(LAYOUT_CASES))
def test_each_bad_layout_field_is_named(change, field):
    base = {"text_tokenizer": "bytes", "base_vocab": 258, "bos_token_id": 256, "eot_token_id": 257,
            "codebook_size": 64}
    with pytest.raises(CheckpointError, match=f"orpheus.json: .*{field}"):
        OrpheusLayout.from_dict({**base, **change}, "orpheus.json")


def test_the_fixture_layout_passes(tmp_path):
    layout = read_layout(FIXTURE, 64)
    assert (layout.base_vocab, layout.bos_token_id, layout.text_tokenizer) == (258, 256, "bytes")


# -------------------------------------------------------------------------------- tokenizer.json

def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hi": 1, "[UNK]": 0}, unk_token="[UNK]")).save(str(path))


@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device")])
def test_a_tokenizer_that_is_not_a_regular_file_is_refused(tmp_path, kind, word):
    pytest.importorskip("tokenizers")
    path = make_hostile(tmp_path / "tokenizer.json", kind)
    _refused(lambda: load_text_tokenizer(tmp_path, TOKENIZER), path, word)


def test_a_corrupt_tokenizer_is_a_checkpoint_error_naming_it(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    _refused(lambda: load_text_tokenizer(tmp_path, TOKENIZER), path, "not a tokenizers JSON file")


def test_an_oversized_tokenizer_is_refused_before_reading(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    _tokenizer_json(path)
    load_text_tokenizer(tmp_path, TOKENIZER)  # the real file loads
    monkeypatch.setattr("flashrt.frontends.orpheus.layout.TOKENIZER_LIMIT", 16)
    _refused(lambda: load_text_tokenizer(tmp_path, TOKENIZER), path, "more than the 16")


@pytest.mark.parametrize("name", ["../outside.json", "/etc/hostname", "sub/../../outside.json"])
def test_the_tokenizer_named_by_the_layout_stays_inside_the_folder(tmp_path, name):
    pytest.importorskip("tokenizers")
    folder = tmp_path / "model"
    folder.mkdir()
    _tokenizer_json(tmp_path / "outside.json")
    with pytest.raises(CheckpointError, match="text_tokenizer"):
        load_text_tokenizer(folder, OrpheusLayout(text_tokenizer=name))


def test_a_tokenizer_linked_to_a_regular_file_loads(tmp_path):
    pytest.importorskip("tokenizers")
    folder = tmp_path / "model"
    folder.mkdir()
    _tokenizer_json(tmp_path / "shared.json")
    (folder / "tokenizer.json").symlink_to(tmp_path / "shared.json")
    assert load_text_tokenizer(folder, TOKENIZER).encode("hi") == [1]


def test_load_tts_names_a_corrupt_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from flashrt.runner.tts import load_tts

    folder = _copy(tmp_path)
    layout = json.loads((folder / "orpheus.json").read_text())
    (folder / "orpheus.json").write_text(json.dumps({**layout, "text_tokenizer": "tokenizer.json"}))
    (folder / "tokenizer.json").write_bytes(b"\x00\xff not json")
    exc = bounded_call(lambda: load_tts(folder, max_new_tokens=8, cache_len=64), timeout_s=60.0)
    assert isinstance(exc, CheckpointError) and "tokenizer.json" in str(exc), repr(exc)


# ------------------------------------------------------------------------------ LM config.json

def _llama() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


LM_CASES = {
    "vocab_size a string": ({"vocab_size": "512"}, "vocab_size"),
    "vocab_size a float": ({"vocab_size": 512.5}, "vocab_size"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "kv heads above heads": ({"num_key_value_heads": 1000}, "num_key_value_heads"),
    "odd head_dim": ({"head_dim": 15}, "head_dim"),
    "eps a string": ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    "eps zero": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    "rope_theta negative": ({"rope_theta": -1.0}, "rope_theta"),
    "rope_parameters a list": ({"rope_parameters": [1, 2]}, "rope_parameters"),
    "rope factor a string": ({"rope_parameters": {"rope_type": "linear", "factor": "2"}},
                             "rope_parameters.factor"),
    "rope_scaling a list": ({"rope_parameters": None, "rope_scaling": [1, 2]}, "rope_scaling"),
    "old-style factor negative": ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear",
                                                                             "factor": -2.0}},
                                  "rope_scaling.factor"),
    "absurd positions": ({"max_position_embeddings": 1 << 40}, "max_position_embeddings"),
    "tie a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
}


@pytest.mark.parametrize("change, field", LM_CASES.values(), ids=list(LM_CASES))
def test_each_bad_lm_config_field_is_named(change, field):
    with pytest.raises(CheckpointError, match=f"config.json: {field}"):
        LMConfig.from_dict({**_llama(), **change}, "config.json")


def test_the_fixture_lm_config_passes():
    cfg = LMConfig.from_dict(_llama())
    assert cfg.vocab_size >= 258 + 10 + 7 * 64


@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device")])
def test_an_lm_config_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind, word):
    path = make_hostile(tmp_path / "config.json", kind)
    _refused(lambda: read_config(tmp_path), path, word)
