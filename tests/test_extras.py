"""flashrt/extras.py: a missing optional package is a user error naming the extra that installs it."""

import re
import tomllib
from pathlib import Path

import pytest

from flashrt.cli import main
from flashrt.extras import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["optional-dependencies"]


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_each_entry_names_an_extra_that_installs_its_distribution(module):
    dist, extra = OPTIONAL[module]
    names = [re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in _extras()[extra]]
    assert dist.lower() in names, (module, extra, names)


def test_serve_without_uvicorn_names_the_serve_extra(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # import uvicorn fails
    code = main(["serve", "--no-warmup", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "flashrt[serve]" in err and "a bug in flashrt" not in err, err


def test_an_unknown_missing_module_is_still_a_bug():
    from flashrt.cli import describe_error

    line, code = describe_error(ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch"))
    assert code == 1 and "a bug in flashrt" in line
