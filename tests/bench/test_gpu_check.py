"""bench/gpu_check.sh cannot rot: its dry run (every step's command, the 480 s budget, the CUDA tests
collect, the GPU scripts parse their arguments) passes on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_gpu_check_dry_run_passes(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry-run: PASS" in done.stdout and "of 480s" in done.stdout


def test_cache_folder_without_platformdirs(monkeypatch):
    from flashrt.paths import user_cache_dir

    monkeypatch.setitem(sys.modules, "platformdirs", None)   # import fails, as on a bare GPU box
    assert user_cache_dir("calibration") == Path.home() / ".cache" / "flashrt" / "calibration"


def test_every_self_budgeted_step_ends_inside_its_step_limit(tmp_path):
    """A bench that budgets itself longer than the script's step limit is killed before its JSON line
    (bench-pi0-gpu once budgeted 170 s under a 120 s limit): its budget must leave a margin."""
    import re

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=230)
    steps = re.findall(r"^dry-run: (\S+) \((\d+)s\): (.*)$", done.stdout, re.M)
    assert any(name == "bench-pi0-gpu" for name, _, _ in steps)
    for name, limit, command in steps:
        budget = re.search(r"--budget-s (\d+(?:\.\d+)?)", command)
        if name == "bench-pi0-gpu":
            assert budget is not None, command  # the bench's default (170 s) would outlive the step
        if budget is not None:
            assert float(budget.group(1)) + 10 <= int(limit), (name, limit, command)
