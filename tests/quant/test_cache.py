"""Calibration cache: hits, misses per key field, corruption detection, atomic concurrent writes
(flashrt/quant/cache.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import threading

import pytest
import safetensors.torch
import torch
from support.quant_cache import TinyConfig, make_key, make_scales

from flashrt.errors import CalibrationError
from flashrt.quant.cache import SCHEME_VERSION, CalibrationCache, canonical_json, default_root
from flashrt.quant.calibrate import Recipe
from flashrt.quant.precision import PrecisionSpec


@pytest.fixture
def cache(tmp_path):
    return CalibrationCache(tmp_path / "cal")


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------ hit / miss


def test_store_then_load_hits(cache):
    key = make_key()
    path = cache.store(key, make_scales())
    assert path.parent == cache.root and path.name.startswith("tiny-") and path.suffix == ".safetensors"
    _assert_same(cache.load(key), make_scales())
    assert cache.last_miss_reason == ""
    again = CalibrationCache(cache.root).load(make_key())  # a fresh process builds an equal key
    _assert_same(again, make_scales())


def test_absent_entry_is_a_quiet_miss(cache, caplog):
    with caplog.at_level(logging.WARNING):
        assert cache.load(make_key()) is None
    assert cache.last_miss_reason == "no entry"
    assert caplog.records == []


def test_canonical_key_ignores_dict_order_and_dataclass_form():
    a = make_key(shapes={"views": 2, "chunk": 10, "steps": 10}, config={"width": 64, "depth": 2})
    b = make_key(shapes={"steps": 10, "chunk": 10, "views": 2}, config=TinyConfig())
    assert a == b and a.digest() == b.digest()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(TypeError, match="plain data"):
        canonical_json({"x": object()})


CHANGED_FIELDS = {
    "data_digest": {"data_digest": "e" * 64},
    "config": {"config": TinyConfig(depth=3)},
    "shapes": {"shapes": {"views": 3, "chunk": 10, "steps": 10}},
    "recipe": {"recipe": Recipe(percentile=99.0).key_fields("s" * 64)},
    "recipe_data": {"recipe": Recipe().key_fields("t" * 64)},
    "precision": {"precision": PrecisionSpec.named("int8").cache_fields()},
    "arch": {"arch": "sm90"},
    "scheme": {"scheme": SCHEME_VERSION + 1},
    "model": {"model": "tiny2"},
}


@pytest.mark.parametrize("field", sorted(CHANGED_FIELDS))
def test_miss_on_each_key_field(cache, field):
    cache.store(make_key(), make_scales())
    other = make_key(**CHANGED_FIELDS[field])
    assert other.digest() != make_key().digest()
    assert cache.load(other) is None
    assert cache.last_miss_reason == "no entry"


@pytest.mark.parametrize("field", sorted(CHANGED_FIELDS))
def test_entry_moved_under_another_key_is_detected(cache, field, caplog):
    """A file copied or renamed to another key's name (e.g. after swapping checkpoint data) is refused."""
    src = cache.store(make_key(), make_scales())
    other = make_key(**CHANGED_FIELDS[field])
    os.replace(src, cache.path_for(other))
    assert cache.load(other) is None
    name = field.split("_")[0] if field != "data_digest" else "data_digest"
    assert cache.last_miss_reason.startswith("key mismatch") and name in cache.last_miss_reason
    assert "not used" in caplog.text


def test_swapped_checkpoint_data_misses(cache, tmp_path):
    ckpt = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(4, 4)}, ckpt)
    key = make_key(data_digest=cache.data_digest(ckpt))
    cache.store(key, make_scales())
    assert cache.load(make_key(data_digest=cache.data_digest(ckpt))) is not None
    swapped = tmp_path / "swap.safetensors"
    safetensors.torch.save_file({"w": torch.full((4, 4), 2.0)}, swapped)  # same size, other values
    os.replace(swapped, ckpt)
    assert cache.load(make_key(data_digest=cache.data_digest(ckpt))) is None
    assert (cache.root / "file-digests.json").exists()


# ------------------------------------------------------------------------------------------ corruption


def _rewrite(path, scales=None, **meta_changes):
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    meta.update(meta_changes)
    path.write_bytes(safetensors.torch.save(scales if scales is not None else tensors, metadata=meta))


def test_corrupt_header_json(cache, caplog):
    key = make_key()
    path = cache.store(key, make_scales())
    data = bytearray(path.read_bytes())
    data[8] = ord("x")  # the header's opening brace
    path.write_bytes(bytes(data))
    assert cache.load(key) is None
    assert "corrupt header JSON" in cache.last_miss_reason
    assert "corrupt header JSON" in caplog.text


def test_corrupt_key_json_in_metadata(cache):
    key = make_key()
    _rewrite(cache.store(key, make_scales()), key='{"data_digest": ')
    assert cache.load(key) is None
    assert "corrupt key JSON" in cache.last_miss_reason


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -1])
def test_truncated_file(cache, keep):
    key = make_key()
    path = cache.store(key, make_scales())
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    assert cache.load(key) is None
    assert "truncated" in cache.last_miss_reason or "unreadable tensors" in cache.last_miss_reason


def test_edited_scale_bytes(cache):
    key = make_key()
    path = cache.store(key, make_scales())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte of the last tensor
    path.write_bytes(bytes(data))
    assert cache.load(key) is None
    assert "scale tensors do not match" in cache.last_miss_reason


def test_edited_scale_values_resaved(cache):
    key = make_key()
    path = cache.store(key, make_scales())
    _rewrite(path, scales=make_scales(0.25))  # valid file, same metadata, other numbers
    assert cache.load(key) is None
    assert "scale tensors do not match" in cache.last_miss_reason


def test_edited_key_metadata(cache):
    key = make_key()
    path = cache.store(key, make_scales())
    fields = json.loads(safetensors.safe_open(path, "pt").metadata()["key"])
    fields["arch"] = "sm90"
    _rewrite(path, key=canonical_json(fields))
    assert cache.load(key) is None
    assert "key fields do not match their recorded digest" in cache.last_miss_reason


def test_foreign_and_future_files(cache):
    key = make_key()
    path = cache.path_for(key)
    path.parent.mkdir(parents=True)
    safetensors.torch.save_file({"fc1": torch.tensor(1.0)}, path)
    assert cache.load(key) is None and "not a flashrt-calibration file" in cache.last_miss_reason
    cache.store(key, make_scales())
    _rewrite(path, format_version="99")
    assert cache.load(key) is None and "format_version" in cache.last_miss_reason


@pytest.mark.parametrize("scales, message", [
    ({}, "empty"),
    ({"a": torch.tensor(float("nan"))}, "non-finite"),
    ({"a": torch.tensor(0.0)}, "non-positive"),
    ({"a": torch.tensor(3)}, "non-float"),
    ({"a": 0.5}, "str -> torch.Tensor"),
])
def test_store_refuses_bad_scales(cache, scales, message):
    with pytest.raises(CalibrationError, match=message):
        cache.store(make_key(), scales)
    assert not cache.root.exists() or not cache.files()


def test_failed_write_keeps_the_old_entry_and_no_temp_file(cache, monkeypatch):
    key = make_key()
    cache.store(key, make_scales())

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.store(key, make_scales(0.75))
    monkeypatch.undo()
    _assert_same(cache.load(key), make_scales())
    assert sorted(p.name for p in cache.root.iterdir()) == [key.filename()]


# ------------------------------------------------------------------------------------------ management


def test_constructor_has_no_side_effects(tmp_path):
    c = CalibrationCache(tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert c.entries() == [] and c.verify() == []
    assert CalibrationCache().root == default_root()
    assert default_root().parts[-2:] == ("flashrt", "calibration")


def test_get_or_calibrate_calls_once(cache):
    calls = []

    def run():
        calls.append(1)
        return make_scales(0.125)

    key = make_key()
    _assert_same(cache.get_or_calibrate(key, run), make_scales(0.125))
    _assert_same(cache.get_or_calibrate(key, run), make_scales(0.125))
    assert len(calls) == 1
    data = bytearray(cache.path_for(key).read_bytes())
    data[-1] ^= 0x01
    cache.path_for(key).write_bytes(bytes(data))
    _assert_same(cache.get_or_calibrate(key, run), make_scales(0.125))  # corrupt -> recalibrated
    assert len(calls) == 2
    assert cache.load(key) is not None


def test_precision_spec_object_keys_by_cache_fields():
    spec = PrecisionSpec.named("fp8")
    renamed = dataclasses.replace(spec, name="my-fp8")
    assert make_key(precision=spec) == make_key(precision=renamed) == make_key()


def test_get_or_calibrate_survives_an_unwritable_cache(cache, monkeypatch, caplog):
    def refuse(path, payload):
        raise PermissionError("read-only file system")

    monkeypatch.setattr("flashrt.quant.cache._atomic_write", refuse)
    _assert_same(cache.get_or_calibrate(make_key(), make_scales), make_scales())
    assert "could not store calibration entry" in caplog.text


def test_entries_and_verify(cache):
    good = cache.store(make_key(), make_scales())
    moved_key = make_key(arch="sm90")
    moved = cache.store(make_key(arch="sm80"), make_scales())
    os.replace(moved, cache.path_for(moved_key))
    broken = cache.store(make_key(model="broken"), make_scales())
    broken.write_bytes(broken.read_bytes()[:20])
    infos = {e.path.name: e for e in cache.entries()}
    assert infos[good.name].key["arch"] == "sm89" and infos[good.name].n_scales == 3
    assert infos[broken.name].key is None and "truncated" in infos[broken.name].problem
    results = {p.name: (ok, reason) for p, ok, reason in cache.verify()}
    assert results[good.name] == (True, "ok")
    moved_ok, moved_reason = results[moved_key.filename()]
    assert moved_ok is False and "renamed or copied" in moved_reason
    assert results[broken.name][0] is False


def test_remove(cache):
    a = cache.store(make_key(model="alpha"), make_scales())
    b = cache.store(make_key(model="beta"), make_scales())
    c = cache.store(make_key(model="beta", arch="sm90"), make_scales())
    assert cache.remove(a.name) == [a]
    assert cache.remove("nothing") == []
    with pytest.raises(ValueError, match="matches 2 entries"):
        cache.remove("beta")
    assert cache.remove(b.stem) == [b]
    (cache.root / ".tmp-leftover.partial").write_bytes(b"x")
    assert sorted(p.name for p in cache.remove(all=True)) == sorted([c.name, ".tmp-leftover.partial"])
    assert list(cache.root.iterdir()) == []
    with pytest.raises(ValueError, match="name an entry"):
        cache.remove()


# ------------------------------------------------------------------------------------------ concurrency

WRITERS, WRITES = 4, 6
VALUES = [0.5 + w + i / 16 for w in range(WRITERS) for i in range(WRITES)]


def _write_many(root: str, writer: int) -> None:
    cache = CalibrationCache(root)
    for i in range(WRITES):
        cache.store(make_key(), make_scales(0.5 + writer + i / 16))


def _check_reads(cache: CalibrationCache, done) -> tuple[int, int]:
    hits = misses = 0
    while True:
        finished = done()
        result = cache.lookup(make_key())
        if result.hit:
            assert result.scales["fc1"].item() in VALUES
            _assert_same(result.scales, make_scales(result.scales["fc1"].item()))
            hits += 1
        else:
            assert result.reason == "no entry", result.reason  # never a half-written file
            misses += 1
        if finished:
            return hits, misses


def _assert_clean_end(cache: CalibrationCache) -> None:
    final = cache.load(make_key())
    assert final is not None and final["fc1"].item() in VALUES
    assert [p.name for p in cache.root.iterdir() if p.name.startswith(".tmp-")] == []
    assert [ok for _, ok, _ in cache.verify()] == [True]


def test_concurrent_writer_threads(cache):
    threads = [threading.Thread(target=_write_many, args=(str(cache.root), w)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    hits, _ = _check_reads(cache, lambda: not any(t.is_alive() for t in threads))
    for t in threads:
        t.join()
    assert hits >= 1
    _assert_clean_end(cache)


def test_concurrent_writer_processes(cache):
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    procs = [ctx.Process(target=_write_many, args=(str(cache.root), w)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    hits, _ = _check_reads(cache, lambda: not any(p.is_alive() for p in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert hits >= 1
    _assert_clean_end(cache)
