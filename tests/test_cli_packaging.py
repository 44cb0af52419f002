"""Packaging habits (issue #19, item 7): one version, typed, licensed."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import flashrt

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_has_one_source():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flashrt.__version__"}
    assert importlib.metadata.version("flashrt") == flashrt.__version__


def test_the_package_is_typed_and_ships_the_marker():
    assert (Path(flashrt.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["flashrt"]
    files = {str(f) for f in importlib.metadata.distribution("flashrt").files or ()}
    assert "flashrt/py.typed" in files


def test_the_license_is_a_file_and_in_the_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == {"text": "Apache-2.0"}
    assert importlib.metadata.metadata("flashrt")["License"] == "Apache-2.0"
