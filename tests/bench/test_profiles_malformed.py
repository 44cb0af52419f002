"""Every key of a profile with every kind of wrong value: a ConfigError naming the file and the key, or a
valid profile; never another exception (flashrt/bench/profiles.py)."""

from __future__ import annotations

import math

import pytest

from flashrt.bench.profiles import parse_profile
from flashrt.errors import ConfigError

KEYS = {
    "": ("description", "precision"),
    "device": ("kind", "model", "threads"),
    "shapes": ("preset", "batch", "buckets", "views", "chunk", "steps"),
    "runtime": ("backend",),
    "bench": ("warmup", "iters", "trace_len", "seed", "target_rate_hz", "soak_steps"),
    "quality": ("reference", "atol", "rtol"),
}
VALUES = {"negative": -1, "zero": 0, "fraction": 1.5, "string": "x", "bool": True, "list": [1],
          "nested list": [[1]], "table": {"a": 1}, "huge": 10**30, "nan": math.nan, "inf": math.inf,
          "empty list": [], "list of strings": ["a"]}


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("key", [f"{s}.{k}" if s else k for s, keys in KEYS.items() for k in keys])
def test_any_bad_value_is_a_config_error_or_valid(key, value):
    section, _, name = key.rpartition(".")
    data = {section: {name: VALUES[value]}} if section else {name: VALUES[value]}
    try:
        parse_profile(data, "p", "profiles/p.toml")
    except ConfigError as exc:
        assert "profiles/p.toml" in str(exc) and name in str(exc)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("section", ["device", "shapes", "runtime", "bench", "quality", "model"])
def test_a_section_that_is_not_a_table(section, value):
    if isinstance(VALUES[value], dict):
        pytest.skip("a table")
    with pytest.raises(ConfigError, match=section):
        parse_profile({section: VALUES[value]}, "p", "profiles/p.toml")


@pytest.mark.parametrize("value", VALUES)
def test_model_table_values(value):
    try:
        profile = parse_profile({"model": {"k": VALUES[value]}}, "p")
    except ConfigError as exc:
        assert "model.k" in str(exc)
    else:
        assert profile.model["k"] == VALUES[value] or math.isnan(VALUES[value])
