"""The project's test command: ruff on the tree, then pytest. Run from the repository root."""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "."])
    if lint.returncode != 0:
        print("ruff found problems (above); fix them before the tests count.", file=sys.stderr)
        return lint.returncode
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *argv]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
