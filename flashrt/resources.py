"""Locate and read the data shipped with flashrt: model cards, deployment profiles, calibration recipes,
and the C/CUDA kernel sources (csrc).

Where the data is: always beside the flashrt package that was actually imported, never through the
import system. A wheel installs it inside the package (``flashrt/_models``, ``flashrt/_csrc``, ...:
setup.py's ``package_dir``); a checkout keeps it at the repository root beside ``flashrt/``
(``models/``, ``csrc/``, ...; the ``setup.py`` there marks a checkout). Asking importlib for
``flashrt._csrc`` instead would follow an editable install's finder to the checkout it was installed
from, so a second copy of the tree put first on ``sys.path`` would run the first copy's kernels and
read its cards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashrt.errors import ConfigError

_KINDS = ("models", "profiles", "calibration", "csrc")  # installed as flashrt._<kind> (setup.py)
_WHAT = {"models": "model card", "profiles": "profile", "calibration": "calibration recipe"}
PACKAGE_DIR = Path(__file__).resolve().parent  # the imported flashrt package


def data_dir(kind: str) -> Path:
    """Folder of one shipped data kind ('models', 'profiles', 'calibration', 'csrc') of the imported
    flashrt package: ``flashrt/_<kind>`` (installed), else ``<checkout>/<kind>`` (module docstring)."""
    if kind not in _KINDS:
        raise ConfigError(f"unknown data kind {kind!r}; known: {sorted(_KINDS)}")
    installed, checkout = PACKAGE_DIR / f"_{kind}", PACKAGE_DIR.parent / kind
    if installed.is_dir():
        return installed
    if checkout.is_dir() and (PACKAGE_DIR.parent / "setup.py").is_file():
        return checkout
    raise ConfigError(f"flashrt's {kind} data is missing: neither {installed} (an installed package) nor "
                      f"{checkout} (a checkout) exists; reinstall flashrt")


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
