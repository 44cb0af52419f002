"""Locate the data shipped with flashrt: model cards, deployment profiles, calibration recipes."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_PACKAGES = {"models": "flashrt._models", "profiles": "flashrt._profiles",
             "calibration": "flashrt._calibration"}


def data_dir(kind: str) -> Path:
    """Folder of one shipped data kind: 'models', 'profiles' or 'calibration'."""
    if kind not in _PACKAGES:
        raise KeyError(f"unknown data kind {kind!r}; known: {sorted(_PACKAGES)}")
    return Path(str(resources.files(_PACKAGES[kind])))


def list_data(kind: str, suffix: str = ".toml") -> dict[str, Path]:
    """name -> path of every shipped file of that kind with the given suffix."""
    return {p.stem: p for p in sorted(data_dir(kind).glob(f"*{suffix}"))}
