"""Typed reads from a parsed config file: every malformed value is a typed error naming file and field.

A checkpoint's ``config.json`` / processor JSON / ``config.yaml`` / model card is untrusted data:
``int(cfg["chunk_size"])`` turns a missing key into a KeyError, ``"50"`` into a silent conversion,
``True`` into 1, ``50.7`` into 50, ``-3`` into a negative size discovered later as an IndexError, and
``1_000_000`` into a 3 GB allocation at the first call. `Fields` reads each value once, with its type
and range, and raises ``error`` (CheckpointError by default, ConfigError for cards and profiles) with
the file and the dotted field name::

    cfg = Fields(read_json(folder / "config.json", "policy config"), folder / "config.json")
    chunk = cfg.int("chunk_size", lo=1, hi=1024)
    steps = cfg.int("num_inference_steps", default=10, lo=1, hi=1000)
    max_len = cfg.table("tokenizer").int("max_length", lo=1, hi=4096)      # field "tokenizer.max_length"
    period = cfg.float("min_period", default=4e-3, lo=0.0, lo_open=True)

Integers: Python ints only (a bool, a float, a string is refused, even ``50.0``). Floats: ints or
floats, finite unless ``finite=False``. Bounds are inclusive unless ``lo_open``/``hi_open``; an absurd
value beyond ``hi`` is refused, or with ``cap=True`` capped to ``hi`` with a warning naming the field.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashrt.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["Fields", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


class Fields:
    """Typed, range-checked access to one mapping read from ``where`` (a file path, or a description)."""

    def __init__(self, data: Any, where: str | os.PathLike[str], error: type[Exception] = CheckpointError,
                 prefix: str = "") -> None:
        self.where, self.error, self.prefix = str(where), error, prefix
        if not isinstance(data, Mapping):
            raise self._fail(self.prefix.rstrip(".") or "<top level>",
                             f"must be a mapping (object / table), got {type(data).__name__}")
        self.data = data

    # ---------------------------------------------------------------------------------- plumbing

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _fail(self, field: str, problem: str) -> Exception:
        return self.error(f"{self.where}: {field}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = MISSING) -> Any:
        """The value as stored (None counts as absent); absent without a default is an error."""
        if self.has(key):
            return self.data[key]
        if default is MISSING:
            raise self._fail(self.name(key), "missing (required)")
        return default

    def unknown(self, known: Sequence[str]) -> None:
        """Refuse keys outside ``known``."""
        extra = sorted(str(k) for k in self.data if k not in known)
        if extra:
            raise self._fail(self.prefix.rstrip(".") or "<top level>",
                             f"unknown key(s) {extra}; known: {sorted(known)}")

    # ------------------------------------------------------------------------------------ values

    def int(self, key: str, default: Any = MISSING, *, lo: int | None = None, hi: int | None = None,
            cap: bool = False) -> int:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(self.name(key), f"expected an integer, got {value!r}")
        return self._bounded(key, value, lo, hi, False, False, cap)

    def float(self, key: str, default: Any = MISSING, *, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False, finite: bool = True) -> float:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(self.name(key), f"expected a number, got {value!r}")
        if finite and not math.isfinite(value):
            raise self._fail(self.name(key), f"must be finite, got {value!r}")
        return float(self._bounded(key, value, lo, hi, lo_open, hi_open, False))

    def str(self, key: str, default: Any = MISSING, *, choices: Sequence[str] | None = None) -> str:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, str):
            raise self._fail(self.name(key), f"expected a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self._fail(self.name(key), f"{value!r} is not one of {list(choices)}")
        return value

    def bool(self, key: str, default: Any = MISSING) -> bool:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, bool):
            raise self._fail(self.name(key), f"expected true or false, got {value!r}")
        return value

    def list(self, key: str, default: Any = MISSING, *, item: type | tuple[type, ...] | None = None,
             max_len: int | None = None) -> list[Any]:
        if not self.has(key):
            return self.raw(key, default)
        value = self.data[key]
        if not isinstance(value, list | tuple):
            raise self._fail(self.name(key), f"expected a list, got {type(value).__name__}")
        if max_len is not None and len(value) > max_len:
            raise self._fail(self.name(key), f"{len(value)} entries, more than the {max_len} allowed")
        if item is not None:
            bad = [v for v in value if isinstance(v, bool) and item is not bool or not isinstance(v, item)]
            if bad:
                raise self._fail(self.name(key), f"entries must be {_names(item)}, got {bad[0]!r}")
        return list(value)

    def table(self, key: str, default: Any = MISSING) -> Fields:
        """The nested mapping at ``key`` as Fields (its field names are prefixed ``key.``)."""
        value = self.raw(key, {} if default is MISSING else default)
        if default is MISSING and not self.has(key):
            raise self._fail(self.name(key), "missing (required)")
        return Fields(value, self.where, self.error, prefix=f"{self.name(key)}.")

    def _bounded(self, key: str, value: Any, lo: Any, hi: Any, lo_open: bool, hi_open: bool,
                 cap: bool) -> Any:
        if lo is not None and (value < lo or (lo_open and value == lo)):
            raise self._fail(self.name(key), f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
        if hi is not None and (value > hi or (hi_open and value == hi)):
            if cap and not hi_open:
                log.warning("%s: %s = %r is beyond the limit %r; using %r", self.where, self.name(key),
                            value, hi, hi)
                return hi
            raise self._fail(self.name(key), f"{value!r} is beyond the limit {hi} flashrt accepts")
        return value


def _names(t: type | tuple[type, ...]) -> str:
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join(x.__name__ for x in types)
