"""Calibration cache entries that are not regular files (/dev/zero, FIFO, directory, dangling link): every
read path (lookup, ls, verify, get_or_calibrate, the CLI) treats them as bad entries, under a memory limit
and a timeout, and a good entry next to them still works."""

from __future__ import annotations

import pytest
import torch
from support.quant_cache import make_key, make_scales
from typer.testing import CliRunner

from flashrt.quant.cache import CalibrationCache
from flashrt.quant.cli import cache_app
from flashrt.testing.hostile import HOSTILE_KINDS, bounded_call, make_hostile

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=HOSTILE_KINDS)
def hostile(request, tmp_path):
    """A cache whose entry for make_key() is hostile, plus a good entry for another key."""
    cache = CalibrationCache(tmp_path / "cal")
    cache.store(make_key(arch="sm90"), make_scales())
    path = make_hostile(cache.path_for(make_key()), request.param)
    return cache, path


def test_lookup_is_a_miss(hostile):
    cache, path = hostile
    result = bounded_call(lambda: _keep(cache.lookup(make_key())), fifos=[path])
    assert result is None and _kept.pop() is not None
    assert cache.lookup(make_key()).hit is False
    assert cache.lookup(make_key(arch="sm90")).hit


def test_get_or_calibrate_replaces_it(hostile):
    cache, path = hostile
    if path.is_dir() and not path.is_symlink():
        pytest.skip("a directory cannot be replaced by a file; the entry stays a miss")
    got = cache.get_or_calibrate(make_key(), lambda: make_scales(0.25))
    assert torch.equal(got["fc1"], torch.tensor(0.25))
    assert cache.lookup(make_key()).hit


def test_entries_and_verify_report_it(hostile):
    cache, path = hostile
    assert bounded_call(lambda: _keep(cache.entries()), fifos=[path]) is None
    rows = {e.path.name: e for e in _kept.pop()}
    assert rows[path.name].problem and rows[path.name].key is None
    assert bounded_call(lambda: _keep(cache.verify()), fifos=[path]) is None
    verdict = {p.name: ok for p, ok, _ in _kept.pop()}
    assert verdict[path.name] is False and verdict[make_key(arch="sm90").filename()] is True


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["verify"]])
def test_cli_does_not_hang(hostile, command):
    cache, path = hostile
    result = bounded_call(lambda: _keep(CliRunner().invoke(cache_app, [*command, "--dir", str(cache.root)])),
                          fifos=[path])
    assert result is None
    run = _kept.pop()
    assert run.exception is None or isinstance(run.exception, SystemExit), run.exception
    assert path.name in run.output or path.stem in run.output


_kept: list = []


def _keep(value):
    _kept.append(value)
    return value


def _flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1:]


@pytest.mark.parametrize("where", ["length prefix", "header start", "header middle", "header end",
                                   "tensor data", "last byte", "truncated", "doubled", "empty"])
def test_damaged_entry_is_a_miss_everywhere(tmp_path, where):
    """Damage at any place of an entry: lookup misses (no exception), ls shows a problem or the stored
    key, verify says BAD, and a fresh store repairs it."""
    cache = CalibrationCache(tmp_path / "cal")
    path = cache.store(make_key(), make_scales())
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    damaged = {"length prefix": lambda: _flip(data, 0), "header start": lambda: _flip(data, 8),
               "header middle": lambda: _flip(data, 8 + n // 2), "header end": lambda: _flip(data, 8 + n - 2),
               "tensor data": lambda: _flip(data, 8 + n + 1), "last byte": lambda: _flip(data, len(data) - 1),
               "truncated": lambda: data[:len(data) // 2], "doubled": lambda: data + data,
               "empty": lambda: b""}[where]()
    path.write_bytes(damaged)
    result = cache.lookup(make_key())
    assert not result.hit and result.reason
    assert len(cache.entries()) == 1
    assert [ok for _, ok, _ in cache.verify()] == [False]
    cache.store(make_key(), make_scales())
    assert cache.lookup(make_key()).hit
