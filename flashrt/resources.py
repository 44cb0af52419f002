"""Locate and read the data shipped with flashrt: model cards, deployment profiles, calibration recipes."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from flashrt.errors import ConfigError

_PACKAGES = {"models": "flashrt._models", "profiles": "flashrt._profiles",
             "calibration": "flashrt._calibration"}
_WHAT = {"models": "model card", "profiles": "profile", "calibration": "calibration recipe"}


def data_dir(kind: str) -> Path:
    """Folder of one shipped data kind: 'models', 'profiles' or 'calibration'."""
    if kind not in _PACKAGES:
        raise ConfigError(f"unknown data kind {kind!r}; known: {sorted(_PACKAGES)}")
    return Path(str(resources.files(_PACKAGES[kind])))


def list_data(kind: str, suffix: str = ".toml") -> dict[str, Path]:
    """name -> path of every shipped file of that kind with the given suffix."""
    return {p.stem: p for p in sorted(data_dir(kind).glob(f"*{suffix}"))}


def read_data(kind: str, name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A shipped TOML file by name (``read_data("models", "pi05-tiny")``) or any TOML file by path, parsed
    through `flashrt.io.files.read_toml` (regular files only, size-capped); ConfigError naming the file."""
    from flashrt.io.files import read_toml

    shipped = list_data(kind)
    if str(name_or_path) in shipped:
        path = shipped[str(name_or_path)]
    elif Path(name_or_path).suffix == ".toml":
        path = Path(name_or_path)
    else:
        raise ConfigError(f"no {_WHAT[kind]} named {str(name_or_path)!r}; shipped: {sorted(shipped)}")
    return read_toml(path, _WHAT[kind], ConfigError)
