"""Untrusted GR00T files (#28.5): the tokenizers and the N1.5 pipeline's statistics file are read as
regular, size-capped files through flashrt.io.files; a FIFO, a link to /dev/zero, a corrupt file or a
state_file naming a path outside the folder is a CheckpointError naming the file (never a hang, a raw
tokenizers/safetensors error, or a file read from elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashrt.errors import CheckpointError
from flashrt.testing.hostile import bounded_call, make_hostile

pytest.importorskip("tokenizers")


def _refused(fn, path: Path, *words: str) -> str:
    exc = bounded_call(fn, timeout_s=20.0, fifos=[path])
    assert isinstance(exc, CheckpointError), repr(exc)
    assert all(w in str(exc) for w in (str(path), *words)), str(exc)
    return str(exc)


@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device")])
def test_a_prompt_tokenizer_that_is_not_a_regular_file_is_refused(tmp_path, kind, word):
    from flashrt.frontends.groot.common.preprocess import PromptTokenizer

    path = make_hostile(tmp_path / "tokenizer.json", kind)
    _refused(lambda: PromptTokenizer(path), path, word)


def test_a_corrupt_prompt_tokenizer_names_the_file(tmp_path):
    from flashrt.frontends.groot.common.preprocess import PromptTokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "NoSuchModel"}}')
    _refused(lambda: PromptTokenizer(path), path, "not a tokenizers JSON file")


@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device")])
def test_an_eagle_tokenizer_json_that_is_not_a_regular_file_is_refused_not_skipped(tmp_path, kind, word):
    from flashrt.frontends.groot.n16.frontend import eagle_tokenizer

    path = make_hostile(tmp_path / "tokenizer.json", kind)
    _refused(lambda: eagle_tokenizer(tmp_path), path, word)


def _pipeline(folder: Path, state_file: str) -> None:
    from flashrt.frontends.groot.n15.frontend import PACK_STEP

    step = {"registry_name": PACK_STEP, "config": {}, "state_file": state_file}
    (folder / "policy_preprocessor.json").write_text(json.dumps({"steps": [step]}))


def _step(folder: Path):
    from flashrt.frontends.groot.n15.frontend import PACK_STEP, _pipeline_step

    return _pipeline_step(folder, "policy_preprocessor", PACK_STEP)


def test_the_statistics_file_is_read(tmp_path):
    from safetensors.numpy import save_file

    save_file({"state.min": np.zeros(3, np.float32)}, str(tmp_path / "stats.safetensors"))
    _pipeline(tmp_path, "stats.safetensors")
    config, state = _step(tmp_path)
    assert config == {} and np.array_equal(state["state.min"], np.zeros(3, np.float32))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hostname"])
def test_a_state_file_outside_the_folder_is_refused(tmp_path, name):
    from safetensors.numpy import save_file

    folder = tmp_path / "policy"
    folder.mkdir()
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "outside.safetensors"))
    _pipeline(folder, name)
    with pytest.raises(CheckpointError, match="state_file"):
        _step(folder)


def test_a_corrupt_state_file_names_it(tmp_path):
    (tmp_path / "stats.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    _pipeline(tmp_path, "stats.safetensors")
    _refused(lambda: _step(tmp_path), tmp_path / "stats.safetensors", "not a safetensors file")


@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "resolves to /dev/zero")])
def test_a_state_file_that_is_not_a_regular_file_is_refused(tmp_path, kind, word):
    path = make_hostile(tmp_path / "stats.safetensors", kind)
    _pipeline(tmp_path, "stats.safetensors")
    exc = bounded_call(lambda: _step(tmp_path), timeout_s=20.0, fifos=[path])
    assert isinstance(exc, CheckpointError) and "stats.safetensors" in str(exc) and word in str(exc), exc
