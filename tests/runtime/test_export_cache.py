"""flashrt/runtime/export_cache.py: every key field changes the key (and only a change does), and the trust
rules of the native caches hold for exported models and TensorRT engines: an entry that is a symlink,
another user's, writable by others, or in a folder others can write is a miss, never used."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flashrt.runtime.export_cache import EngineKey, ExportCache, ExportKey

FOREIGN_UID = 54321


def _export_key(**changes) -> ExportKey:
    fields = {"weights": "cd" * 32, "program": "ef" * 32, "shapes": '{"x":[1,2]}',
              "precision": "torch.float32", "exporter": "torch 2.9 onnxscript 0.5",
              "runtime": "onnxruntime 1.22", "arch": "cpu-x86_64",
              "scheme": 1, "model": "graph"}
    return ExportKey(**{**fields, **changes})


def _engine_key(**changes) -> EngineKey:
    fields = {"weights": "cd" * 32, "program": "ef" * 32, "shapes": '{"x":[1,2]}', "precision": "fp16",
              "exporter": "torch 2.9", "onnx": "01" * 32, "builder": '{"opt":3}', "scales": "",
              "runtime": "tensorrt 10.9", "arch": "sm90", "device": "NVIDIA H100", "scheme": 1,
              "model": "trt"}
    return EngineKey(**{**fields, **changes})


def _changed(value):
    return value + 1 if isinstance(value, int) else value + "-changed"


KEYS = {"onnx": _export_key, "engine": _engine_key}
FIELDS = [(kind, f.name) for kind, make in KEYS.items() for f in dataclasses.fields(make())]


@pytest.mark.parametrize(("kind", "field"), FIELDS, ids=[f"{k}-{f}" for k, f in FIELDS])
def test_each_key_field_changes_the_key_and_misses(tmp_path, kind, field):
    make = KEYS[kind]
    key = make()
    other = make(**{field: _changed(getattr(key, field))})
    assert other.digest() != key.digest() and other.filename() != key.filename()
    cache = ExportCache(tmp_path)
    cache.store(key, b"model bytes")
    assert cache.load(other) is None
    assert cache.load(key) == b"model bytes"


@pytest.mark.parametrize("kind", KEYS)
def test_the_key_is_stable_when_nothing_changes(kind):
    assert KEYS[kind]().digest() == KEYS[kind]().digest()
    assert KEYS[kind]().filename() == KEYS[kind]().filename()


@pytest.fixture
def stored(tmp_path):
    cache = ExportCache(tmp_path / "cache")
    key = _engine_key()
    path = cache.store(key, b"engine bytes")
    assert cache.load(key) == b"engine bytes"
    return cache, key, path


def test_a_folder_flashrt_creates_is_private(stored):
    cache, _, _ = stored
    assert os.stat(cache.root).st_mode & 0o777 == 0o700


def _symlink(path, tmp_path):
    real = tmp_path / "elsewhere.trtengine"
    os.replace(path, real)
    path.symlink_to(real)


def _foreign(path, tmp_path):
    os.chown(path, FOREIGN_UID, FOREIGN_UID)


def _writable_entry(path, tmp_path):
    os.chmod(path, 0o666)


def _writable_folder(path, tmp_path):
    os.chmod(path.parent, 0o777)


HOSTILE = {"symlink": (_symlink, "is a symlink"),
           "foreign owner": (_foreign, f"belongs to uid {FOREIGN_UID}"),
           "writable entry": (_writable_entry, "writable by other users"),
           "writable folder": (_writable_folder, "untrusted cache folder")}


@pytest.mark.parametrize("how", HOSTILE)
def test_an_entry_failing_the_trust_rules_is_a_miss(stored, tmp_path, how):
    if how == "foreign owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    cache, key, path = stored
    change, reason = HOSTILE[how]
    change(path, tmp_path)  # the bytes and the header stay consistent: only the trust rules catch it
    assert cache.load(key) is None
    assert reason in cache.last_miss_reason
    assert reason in cache.entries()[0].problem


def test_nothing_is_stored_in_a_folder_others_can_write(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    cache = ExportCache(folder)
    payload, hit = cache.get_or_export(_export_key(), lambda: b"exported")
    assert (payload, hit) == (b"exported", False)
    assert list(folder.iterdir()) == []
