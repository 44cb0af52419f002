#!/usr/bin/env python3
"""The README's two set-up commands: `python3 bootstrap.py main` and `python3 bootstrap.py test`.

Creates (or reuses) `.venv` beside this file with access to the system site-packages, so a torch that
is already installed — a user's CUDA build — is kept. Where no torch is importable it installs
torch==2.13.0 first (a bare `torch` requirement could pull a multi-GB CUDA build), then installs
flashrt in editable mode with the extras the job needs. Re-installs only when the packaging files
change. Only the standard library is used here: this runs on a machine with nothing but Python + pip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH_PIN = "torch==2.13.0"
JOBS = {
    "main": ("test", ["-m", "flashrt.cli", "demo"]),
    "test": ("test", ["-m", "flashrt.testing.run_suite"]),
}


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def ensure_venv() -> Path:
    py = venv_python()
    if not py.exists():
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV)
    return py


def has_torch(py: Path) -> bool:
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True)
    return probe.returncode == 0


def packaging_digest(extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for name in ("pyproject.toml", "setup.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def ensure_installed(py: Path, extra: str) -> None:
    if not has_torch(py):
        run([str(py), "-m", "pip", "install", "-q", TORCH_PIN])
    stamp = VENV / ".flashrt-installed"
    digest = packaging_digest(extra)
    if stamp.exists() and stamp.read_text() == digest:
        return
    run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extra}]"])
    stamp.write_text(digest)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in JOBS:
        print(f"usage: python3 bootstrap.py {{{'|'.join(JOBS)}}} [args...]", file=sys.stderr)
        return 2
    extra, cmd = JOBS[argv[0]]
    py = ensure_venv()
    ensure_installed(py, extra)
    return subprocess.run([str(py), *cmd, *argv[1:]], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
