"""flashrt/io/fields.py: typed reads from parsed configs; every bad value is the given error type, naming
file and dotted field."""

from __future__ import annotations

import logging

import pytest

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io.fields import Fields

CFG = {"chunk_size": 50, "min_period": 0.004, "type": "pi0", "flag": True, "names": ["a", "b"],
       "tok": {"max_length": 48}, "none": None}


def f(data=CFG, error=CheckpointError):
    return Fields(data, "ckpt/config.json", error)


def test_good_values():
    cfg = f()
    assert cfg.int("chunk_size", lo=1, hi=1024) == 50
    assert cfg.float("min_period", lo=0.0, lo_open=True) == 0.004
    assert cfg.float("chunk_size") == 50.0 and isinstance(cfg.float("chunk_size"), float)
    assert cfg.str("type", choices=("pi0", "pi05")) == "pi0"
    assert cfg.bool("flag") is True and cfg.list("names", item=str) == ["a", "b"]
    assert cfg.table("tok").int("max_length") == 48
    assert cfg.int("absent", default=7) == 7 and cfg.int("none", default=3) == 3  # null counts as absent
    assert cfg.table("absent", default={}).int("x", default=1) == 1


BAD = {
    "missing": (lambda c: c.int("n_action_steps"), "n_action_steps: missing"),
    "int from bool": (lambda c: c.int("flag"), "flag: expected an integer, got True"),
    "int from float": (lambda c: c.int("min_period"), "min_period: expected an integer"),
    "int from string": (lambda c: c.int("type"), "type: expected an integer, got 'pi0'"),
    "int below": (lambda c: c.int("chunk_size", lo=64), "chunk_size: must be >= 64, got 50"),
    "int absurd": (lambda c: c.int("chunk_size", hi=10), "chunk_size: 50 is beyond the limit 10"),
    "float open bound": (lambda c: c.float("min_period", lo=0.004, lo_open=True), "min_period: must be > "),
    "float from string": (lambda c: c.float("type"), "type: expected a number"),
    "float from bool": (lambda c: c.float("flag"), "flag: expected a number"),
    "str from int": (lambda c: c.str("chunk_size"), "chunk_size: expected a string"),
    "str choice": (lambda c: c.str("type", choices=("pi05",)), "type: 'pi0' is not one of"),
    "bool from int": (lambda c: c.bool("chunk_size"), "chunk_size: expected true or false"),
    "list from str": (lambda c: c.list("type"), "type: expected a list"),
    "list items": (lambda c: c.list("names", item=int), "names: entries must be int"),
    "list too long": (lambda c: c.list("names", max_len=1), "names: 2 entries"),
    "table from int": (lambda c: c.table("chunk_size"), "chunk_size: must be a mapping"),
    "table missing": (lambda c: c.table("absent"), "absent: missing"),
    "nested field named": (lambda c: c.table("tok").int("max_length", hi=16), "tok.max_length: 48 is beyond"),
    "nested missing": (lambda c: c.table("tok").int("pad"), "tok.pad: missing"),
    "unknown keys": (lambda c: c.table("tok").unknown(["pad"]), r"tok: unknown key\(s\) \['max_length'\]"),
}


@pytest.mark.parametrize("error", [CheckpointError, ConfigError])
@pytest.mark.parametrize("case", BAD)
def test_bad_values_name_file_and_field(case, error):
    read, match = BAD[case]
    with pytest.raises(error, match=match) as err:
        read(f(error=error))
    assert str(err.value).startswith("ckpt/config.json: ")


@pytest.mark.parametrize("data", [[1, 2], "text", 3, None])
def test_top_level_must_be_a_mapping(data):
    with pytest.raises(CheckpointError, match="must be a mapping"):
        f(data)


def test_cap_warns_and_caps(caplog):
    with caplog.at_level(logging.WARNING):
        got = f({"tokenizer_max_length": 1_000_000}).int("tokenizer_max_length", hi=4096, cap=True)
    assert got == 4096 and "tokenizer_max_length = 1000000 is beyond the limit 4096" in caplog.text


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused(value):
    with pytest.raises(CheckpointError, match="must be finite"):
        f({"x": value}).float("x")
    assert f({"x": value}).float("x", finite=False) != 0.0
