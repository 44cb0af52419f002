"""Profiles, recipes and trace files that are not regular files, not text, or hold absurd values: a typed
error naming the file, under a memory limit and a timeout (flashrt/bench/profiles.py, bench/trace.py,
quant/calibrate.py)."""

from __future__ import annotations

import pytest
import torch

from flashrt.bench.profiles import load_profile
from flashrt.bench.trace import FrozenTrace
from flashrt.errors import ConfigError, InputError
from flashrt.quant.calibrate import load_recipe
from flashrt.testing.hostile import HOSTILE_KINDS, bounded_call, make_hostile

pytestmark = pytest.mark.timeout(120)

READERS = {
    "profile": (load_profile, "p.toml", ConfigError, "profile"),
    "recipe": (load_recipe, "r.toml", ConfigError, "calibration recipe"),
    "trace": (FrozenTrace.load, "trace.pt", InputError, "trace file"),
}


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_hostile_file(tmp_path, reader, kind):
    load, name, error, what = READERS[reader]
    path = make_hostile(tmp_path / name, kind)
    exc = bounded_call(lambda: load(path), fifos=[path])
    assert isinstance(exc, error), repr(exc)
    assert what in str(exc) and str(path) in str(exc)


JUNK = {"binary": bytes(range(256)) * 4, "empty": b"", "text": b"hello\n",
        "zip-like": b"PK\x03\x04" + b"\0" * 60}


@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("reader", READERS)
def test_junk_file(tmp_path, reader, junk):
    load, name, error, what = READERS[reader]
    path = tmp_path / name
    path.write_bytes(JUNK[junk])
    if reader != "trace" and junk in ("empty",):  # an empty TOML is a valid, all-default file
        load(path)
        return
    with pytest.raises(error) as err:
        load(path)
    assert str(path) in str(err.value) or what in str(err.value)


TRACE_DATA = {
    "a list": [1, 2],
    "wrong format": {"format": "other"},
    "no inputs": {"format": "flashrt.trace/1", "digests": []},
    "inputs not a list": {"format": "flashrt.trace/1", "inputs": 3, "digests": []},
    "digests not a list": {"format": "flashrt.trace/1", "inputs": [torch.ones(2)], "digests": None},
    "digests wrong": {"format": "flashrt.trace/1", "inputs": [torch.ones(2)], "digests": ["x"]},
    "empty inputs": {"format": "flashrt.trace/1", "inputs": [], "digests": []},
}


@pytest.mark.parametrize("case", TRACE_DATA)
def test_malformed_trace_file(tmp_path, case):
    path = tmp_path / "trace.pt"
    torch.save(TRACE_DATA[case], path)
    with pytest.raises(InputError):
        FrozenTrace.load(path)


ABSURD = {
    "iters": "[bench]\niters = 10_000_000_000",
    "trace_len": "[bench]\ntrace_len = 1_000_000_000",
    "soak_steps": "[bench]\nsoak_steps = 1_000_000_000_000",
    "warmup": "[bench]\nwarmup = 1_000_000_000",
    "target_rate_hz": "[bench]\ntarget_rate_hz = 1e12",
    "batch": "[shapes]\nbatch = 1_000_000",
    "buckets": "[shapes]\nbuckets = [16, 1_000_000_000]",
    "chunk": "[shapes]\nchunk = 100_000_000",
    "steps": "[shapes]\nsteps = 1_000_000",
    "views": "[shapes]\nviews = 10_000",
    "threads": "[device]\nthreads = 1_000_000",
}


@pytest.mark.parametrize("key", ABSURD)
def test_absurd_profile_values_are_refused(tmp_path, key):
    path = tmp_path / "p.toml"
    path.write_text(ABSURD[key])
    with pytest.raises(ConfigError, match=rf"p.toml: \[\w+\]: bad value for {key}: .* sane limit"):
        load_profile(path)


def test_profile_limits_leave_real_values_alone(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[bench]\niters = 100000\nsoak_steps = 1000000\n[shapes]\nbuckets = [16, 32, 48]")
    assert load_profile(path).bench.iters == 100_000


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_hostile_model_card(tmp_path, kind):
    from flashrt.resources import read_data

    path = make_hostile(tmp_path / "card.toml", kind)
    exc = bounded_call(lambda: read_data("models", path), fifos=[path])
    assert isinstance(exc, ConfigError) and "model card" in str(exc), repr(exc)


def test_shipped_cards_read_and_unknown_names_are_typed():
    from flashrt.resources import data_dir, list_data, read_data

    for name in list_data("models"):
        assert isinstance(read_data("models", name), dict)
    with pytest.raises(ConfigError, match="no model card named 'nope'"):
        read_data("models", "nope")
    with pytest.raises(ConfigError, match="unknown data kind"):
        data_dir("weights")
