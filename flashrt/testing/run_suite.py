"""The project's test command: ruff on the tree, then pytest. Run from the repository root.

pytest runs in `WORKERS` processes (pytest-xdist, the test extra) where the machine has the cores:
serially the suite keeps about one core busy (most tests are small models, bound by dispatch, not
FLOPs; docs/contributing.md has the times). ``--dist loadfile``
keeps each test file in one worker, so a module's fixtures (a Ray cluster, a server on a fixed port,
an exported graph) exist once. Options given after the command come later on pytest's command line
and win (``-n 0``: serially).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

WORKERS = 2  # measured on 2 cores; more would also run more servers and timing-checked tests at once


def cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def xdist_options(available: int) -> list[str]:
    """pytest-xdist's options for ``available`` cores: none with one core or without pytest-xdist."""
    workers = min(WORKERS, available)
    if workers < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers), "--dist", "loadfile"]


def main(argv: list[str]) -> int:
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "."])
    if lint.returncode != 0:
        print("ruff found problems (above); fix them before the tests count.", file=sys.stderr)
        return lint.returncode
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *xdist_options(cores()), *argv]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
