"""The suite's own rules (tests/conftest.py, pyproject's pytest section): every package a test imports is
declared, a skip for a missing declared dependency fails a CI run, every test has a finite timeout.

The rules are checked by running tiny test folders in a subprocess with this checkout's conftest and
pytest settings (so CI=true can be set for that run alone)."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
_spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
suite = importlib.util.module_from_spec(_spec)  # tests/conftest.py's helpers, as a plain module
_spec.loader.exec_module(suite)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# packages some tests import that live only in the reference environment (their tests skip elsewhere,
# by design): NOT declared test dependencies. Anything else a test imports must be declared.
REFERENCE_ONLY = {"lerobot", "tensorrt"}
# optional extras left out of the test extra on purpose; their tests skip, naming the extra, without them
# (none today: ray is in the test extra, so CI runs the Ray Serve tests)
SKIPPED_WITHOUT: set[str] = set()
# folders of reference-env generators (tests/fixtures/gen) are not run by the suite
NOT_RUN = (TESTS / "fixtures" / "gen",)

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------- every import is declared
def _imported_modules(path: Path) -> set[str]:
    """Top-level names a test file imports or `importorskip`s (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return {n.split(".")[0] for n in names}


def _local_modules() -> set[str]:
    """Modules the suite itself puts on the path (tests/support, tests/fixtures/gen, conftest, and the
    packages this repository ships under packages/)."""
    found = {"conftest", "flashrt"}
    for folder in (TESTS, TESTS / "fixtures" / "gen"):
        found |= {p.stem for p in folder.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    found |= {p.name for p in (ROOT / "packages").iterdir() if p.is_dir()}  # this repo's own packages
    return found | {p.name for p in TESTS.iterdir() if p.is_dir()}


def test_every_package_the_tests_import_is_a_declared_test_dependency():
    declared = suite.declared_test_dependencies(ROOT / "pyproject.toml")
    core = {suite.canonical(Requirement(line).name) for line in PYPROJECT["project"]["dependencies"]}
    owners = metadata.packages_distributions()
    local, undeclared = _local_modules(), {}
    for path in TESTS.rglob("*.py"):
        if any(path.is_relative_to(folder) for folder in NOT_RUN):
            continue
        skipped = local | REFERENCE_ONLY | SKIPPED_WITHOUT | set(sys.stdlib_module_names)
        for module in _imported_modules(path) - skipped:
            dists = {suite.canonical(d) for d in owners.get(module, [])} or {suite.canonical(module)}
            if not dists & (declared | core):
                undeclared.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, (f"tests import packages that pyproject's test extra does not declare (add them, "
                            f"or to REFERENCE_ONLY if they live only in the reference env): {undeclared}")


def test_the_audit_reads_imports_and_importorskips(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("import a.b\nfrom c.d import e\nfrom . import f\nimport pytest\n"
                 "x = pytest.importorskip('g.h')\n")
    assert _imported_modules(f) == {"a", "c", "pytest", "g"}


# ---------------------------------------------------------------------------- skips under CI
def _pytest_section(**override) -> str:
    """This checkout's [tool.pytest.ini_options] as TOML (values are strings, numbers, string lists)."""
    ini = {**PYPROJECT["tool"]["pytest"]["ini_options"], "testpaths": ["."], **override}
    return "[tool.pytest.ini_options]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in ini.items())


def _run(folder: Path, files: dict[str, str], test_extra: list[str], ci: bool, *args: str):
    """Run pytest on ``files`` in ``folder`` with this suite's conftest and settings; (rc, output)."""
    folder.mkdir()
    (folder / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "tiny"\nversion = "0"\n[project.optional-dependencies]\n'
        f"test = {json.dumps(test_extra)}\n" + _pytest_section())
    for name, text in files.items():
        (folder / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=150)
    return proc.returncode, proc.stdout + proc.stderr


MISSING = "flashrt-never-installed-dep"          # declared in the tiny project, installed nowhere
PASSING = {"test_ok.py": "def test_ok():\n    assert True\n"}


def _skip_module(module: str, reason: str | None = None) -> dict[str, str]:
    arg = f"{module!r}" + (f", reason={reason!r}" if reason else "")
    test = f"import pytest\npytest.importorskip({arg})\n\ndef test_x():\n    pass\n"
    return {"test_dep.py": test, **PASSING}


def test_ci_fails_a_skip_for_a_missing_declared_dependency(tmp_path):
    rc, out = _run(tmp_path / "t", _skip_module("flashrt_never_installed_dep"), ["pytest", MISSING], ci=True)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "missing declared test dependencies: FAILS the run" in out
    assert "test_dep.py: skipped for a declared dependency" in out
    assert "1 passed, 1 skipped" in out


def test_outside_ci_the_same_skip_is_only_reported(tmp_path):
    rc, out = _run(tmp_path / "t", _skip_module("flashrt_never_installed_dep"), ["pytest", MISSING], ci=False)
    assert rc == pytest.ExitCode.OK, out
    assert "would fail the run under CI=true" in out
    assert "SKIPPED [1] test_dep.py" in out, "the project's -ra lists module-level skips with their reason"


def test_ci_fails_a_declared_dependency_that_is_not_installed_even_behind_a_custom_reason(tmp_path):
    files = _skip_module("flashrt_never_installed_dep", reason="the dep is not here")
    rc, out = _run(tmp_path / "t", files, ["pytest", MISSING], ci=True)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert f"declared in the 'test' extra but not installed: {suite.canonical(MISSING)}" in out


def test_ci_keeps_a_skip_of_an_undeclared_package_a_plain_skip(tmp_path):
    rc, out = _run(tmp_path / "t", _skip_module("flashrt_undeclared_ref_only"), ["pytest"], ci=True)
    assert rc == pytest.ExitCode.OK, out
    assert "1 passed, 1 skipped" in out and "missing declared" not in out
    assert "SKIPPED [1] test_dep.py" in out


def test_a_declared_package_that_imports_under_another_name_is_recognised():
    # yaml is PyYAML's (a core dependency, always installed): found through the installed file lists
    assert suite.declares_module("yaml", {suite.canonical("PyYAML")})
    assert not suite.declares_module("yaml", {"some_other_dist"})
    assert suite.declares_module("never_installed_x", {"never_installed_x"})  # a missing one, by name


# ---------------------------------------------------------------------------- a timeout on every test
def test_the_project_sets_a_finite_timeout_for_every_test(pytestconfig):
    timeout = float(pytestconfig.getini("timeout"))
    assert 0 < timeout < math.inf and timeout <= 600, "generous but finite; the suite must stay < 15 min"
    assert pytestconfig.getini("timeout_method") == "thread"
    assert "-ra" in pytestconfig.getini("addopts"), "every skip's reason is listed at the end"


def test_a_hang_fails_under_the_projects_timeout_settings(tmp_path):
    hang = {"test_hang.py": "import threading\n\ndef test_hang():\n    threading.Event().wait()\n"}
    rc, out = _run(tmp_path / "t", hang, ["pytest"], False, "-o", "timeout=2")
    assert rc != 0 and "Timeout" in out, out
