"""The test command's pytest options: two workers where two cores are, none on one core or without
pytest-xdist, each test file kept in one worker; the test extra declares pytest-xdist."""

import tomllib
from pathlib import Path

from flashrt.testing import run_suite

ROOT = Path(__file__).resolve().parents[2]


def test_two_cores_get_two_workers_that_keep_each_file_together():
    assert run_suite.xdist_options(2) == ["-n", "2", "--dist", "loadfile"]


def test_more_cores_still_get_the_measured_worker_count():
    assert run_suite.xdist_options(64) == ["-n", str(run_suite.WORKERS), "--dist", "loadfile"]


def test_one_core_runs_serially():
    assert run_suite.xdist_options(1) == []


def test_without_xdist_the_suite_runs_serially(monkeypatch):
    monkeypatch.setattr(run_suite.importlib.util, "find_spec", lambda name: None)
    assert run_suite.xdist_options(2) == []


def test_the_test_extra_declares_xdist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-xdist") for req in extras["test"])


def test_options_given_after_the_command_come_last(monkeypatch):
    seen = []

    def fake_run(cmd, **_):
        seen.append(cmd)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(run_suite.subprocess, "run", fake_run)
    monkeypatch.setattr(run_suite, "cores", lambda: 2)
    assert run_suite.main(["-n", "0", "-k", "buffers"]) == 0
    pytest_cmd = seen[-1]
    assert pytest_cmd[pytest_cmd.index("pytest"):] == ["pytest", "-q", "-n", "2", "--dist", "loadfile",
                                                       "-n", "0", "-k", "buffers"]
