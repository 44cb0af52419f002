"""The README's two set-up commands and the CI entry point stay consistent with bootstrap.py.

(The commands themselves are run end to end in a fresh clone by CI: `.ci/run` is `bootstrap.py test`.)
"""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bootstrap():
    spec = importlib.util.spec_from_file_location("_flashrt_bootstrap", ROOT / "bootstrap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_has_exactly_the_two_bootstrap_commands():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 bootstrap\.py (\w+)", readme, flags=re.M)
    assert commands == ["main", "test"]
    assert sorted(_bootstrap().JOBS) == ["main", "test"]


def test_ci_runs_the_readme_test_command_and_nothing_else():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    assert code[-1] == "exec python3 bootstrap.py test"
    assert all(ln.startswith(("set ", "cd ", "exec ")) for ln in code)


def test_jobs_point_at_importable_entry_points():
    for _extra, cmd in _bootstrap().JOBS.values():
        assert cmd[0] == "-m"
        assert importlib.util.find_spec(cmd[1]) is not None, cmd[1]


def test_reinstall_only_when_packaging_changes(tmp_path, monkeypatch):
    boot = _bootstrap()
    for name in ("pyproject.toml", "setup.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(boot, "ROOT", tmp_path)
    first = boot.packaging_digest("test")
    assert boot.packaging_digest("test") == first
    assert boot.packaging_digest("dev") != first
    (tmp_path / "pyproject.toml").write_text("# changed\n")
    assert boot.packaging_digest("test") != first


def test_existing_torch_is_detected_and_kept():
    boot = _bootstrap()
    assert boot.has_torch(Path(sys.executable))  # this interpreter has torch: nothing would be installed
