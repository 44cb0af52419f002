"""flashrt/resources.py: shipped data (cards, profiles, recipes, kernel sources) is read from the flashrt
package actually imported, never from the checkout an editable install points at."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flashrt
from flashrt.errors import ConfigError
from flashrt.ops import csrc, csrc_cpu
from flashrt.resources import data_dir

PACKAGE = Path(flashrt.__file__).resolve().parent
KINDS = ("models", "profiles", "calibration", "csrc")
PROBE = """
import json
import flashrt
from flashrt.resources import data_dir
from flashrt.ops import csrc, csrc_cpu
print(json.dumps({"package": flashrt.__file__, "csrc": str(csrc.csrc_dir()),
                  "cpu_sources": [str(p) for p in csrc_cpu.sources()],
                  **{kind: str(data_dir(kind)) for kind in ("models", "profiles", "calibration")}}))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_data_is_beside_the_imported_package(kind):
    folder = data_dir(kind)
    assert folder in (PACKAGE / f"_{kind}", PACKAGE.parent / kind)  # installed, or this checkout
    assert folder.is_dir() and any(folder.iterdir())


def test_kernel_sources_are_those_of_the_imported_package():
    root = PACKAGE.parent
    assert csrc.csrc_dir().is_relative_to(root)
    assert all(p.is_relative_to(root) for p in (*csrc.sources(), *csrc_cpu.sources()))


def test_unknown_kind():
    with pytest.raises(ConfigError, match="unknown data kind"):
        data_dir("weights")


def _copy_checkout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, dest / "flashrt", ignore=ignore)
    for kind in KINDS:
        shutil.copytree(data_dir(kind), dest / kind, ignore=ignore)
    (dest / "setup.py").write_text("# marks a checkout\n")
    return dest


def _probe(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tree, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_another_copy_of_the_tree_reads_its_own_sources(tmp_path):
    """A second checkout first on PYTHONPATH (while this one may be installed editable) uses its kernels."""
    tree = _copy_checkout(tmp_path / "copy")
    found = _probe(tree)
    assert Path(found["package"]).resolve() == tree / "flashrt" / "__init__.py"
    assert Path(found["csrc"]) == tree / "csrc"
    assert found["cpu_sources"] and all(Path(p).parent == tree / "csrc" for p in found["cpu_sources"])
    assert all(Path(found[kind]) == tree / kind for kind in ("models", "profiles", "calibration"))


def test_an_installed_layout_reads_the_data_inside_the_package(tmp_path):
    """As a wheel lays it out: flashrt/_csrc, flashrt/_models, ... and no setup.py beside the package."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "flashrt", ignore=shutil.ignore_patterns("__pycache__"))
    for kind in KINDS:
        shutil.copytree(data_dir(kind), site / "flashrt" / f"_{kind}")
    (site / "csrc").mkdir()  # an unrelated top-level folder of another distribution: never used
    found = _probe(site)
    assert Path(found["csrc"]) == site / "flashrt" / "_csrc"
    assert Path(found["models"]) == site / "flashrt" / "_models"
