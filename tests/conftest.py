"""Fixtures shared by the whole suite; `tests/support/` (readers of the committed fixtures) is put on
the import path here, so test modules import it as `support`.

Skips that hide a broken install. A test counts only if it ran: every skip is listed with its reason
at the end (``-ra`` in the project's addopts), and under CI (env ``CI=true``) the session fails when
a skip was caused by a missing *declared* test dependency (a distribution of the ``test`` extra in
the rootdir's pyproject.toml), or when any declared test dependency is not installed at all (a skip
with a custom reason cannot name its module; the install is broken either way). A skip of an
undeclared package (one that lives only in the reference environment, e.g. lerobot) stays a skip.
"""

import gc
import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))

EXTRA = "test"
_CLEAN = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


@pytest.fixture(autouse=True)
def _heap_unfrozen():
    """The servers, the demo and the loop bench freeze the heap once loaded (`flashrt.runtime.heap`);
    in the suite's one process each test's objects go back to the collector after it."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="module")
def one_thread():
    """Run single-threaded: on a loaded 2-core machine every parallel op waits for a descheduled OpenMP
    worker (measured 0.2 ms -> 15 ms per op); results are the same. Restored afterwards."""
    import torch  # here, not at the top: tests/test_conftest.py runs this conftest in small subprocesses

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------- skips vs. declared deps
def canonical(name: str) -> str:
    """A distribution or import name compared loosely (PEP 503: case, '-', '_' and '.' alike)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def declared_test_dependencies(pyproject: Path, extra: str = EXTRA) -> set[str]:
    """Canonical names of the distributions the ``extra`` declares (those whose marker holds here)."""
    if not pyproject.is_file():
        return set()
    project = tomllib.loads(pyproject.read_text())["project"]
    names = set()
    for line in project.get("optional-dependencies", {}).get(extra, []):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            names.add(canonical(req.name))
    return names


def not_installed(declared: set[str]) -> list[str]:
    missing = []
    for name in sorted(declared):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def skipped_module(report) -> str | None:
    """The module an `importorskip` (default reason) could not import, else None."""
    found = _IMPORT_SKIP.search(_reason(report))
    return found.group(1).split(".")[0] if found else None


def declares_module(module: str, declared: set[str]) -> bool:
    """Whether ``module`` belongs to a declared distribution: by the installed distributions' file lists
    (an installed but broken package), else by name (a missing package named as it imports)."""
    owners = metadata.packages_distributions().get(module, [])
    return any(canonical(d) in declared for d in owners) or canonical(module) in declared


class SkipLedger:
    """Collects the session's skips; at the end judges them against the declared test extra."""

    def __init__(self, config) -> None:
        self.config, self.skips, self.caused, self.missing = config, [], [], []

    def pytest_collectreport(self, report):
        if report.skipped:
            self.skips.append(report)

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(report)

    def pytest_sessionfinish(self, session):
        declared = declared_test_dependencies(self.config.rootpath / "pyproject.toml")
        self.caused = [r for r in self.skips
                       if (m := skipped_module(r)) is not None and declares_module(m, declared)]
        self.missing = not_installed(declared)
        if in_ci() and (self.caused or self.missing) and session.exitstatus in _CLEAN:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        if self.skips:
            tr.write_line(f"{len(self.skips)} skip(s) did not run (each reason in the short summary, -ra)")
        if not (self.caused or self.missing):
            return
        verdict = "FAILS the run (CI=true)" if in_ci() else "would fail the run under CI=true"
        tr.section(f"missing declared test dependencies: {verdict}", sep="-", red=True, bold=True)
        for r in self.caused:
            tr.write_line(f"{r.nodeid or r.fspath}: skipped for a declared dependency: {_reason(r)}")
        if self.missing:
            tr.write_line(f"declared in the '{EXTRA}' extra but not installed: {', '.join(self.missing)}")


def _reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_configure(config):
    config.pluginmanager.register(SkipLedger(config), "flashrt-skip-ledger")
