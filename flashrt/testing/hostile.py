"""Hostile files for tests, and a call that cannot take the machine down while reading them.

``make_hostile(path, kind)`` puts a non-regular file where a reader expects one: ``"dev-zero"`` (a link
to /dev/zero: endless bytes), ``"fifo"`` (a named pipe: ``open()`` blocks until a writer comes),
``"directory"`` or ``"dangling"`` (a link to nothing). `bounded_call` runs the read in a thread under
a soft address-space limit of the current size plus ``headroom`` and a timeout; a regression then fails
the test (MemoryError, or "did not finish") instead of eating the machine's memory or hanging CI. A
reader stuck on a FIFO is released afterwards by opening the FIFO's write end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

HOSTILE_KINDS = ("dev-zero", "fifo", "directory", "dangling")


def make_hostile(path: str | os.PathLike[str], kind: str) -> Path:
    """Create a non-regular file of ``kind`` (one of HOSTILE_KINDS) at ``path``; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(path.parent / f".{path.name}.absent")
    else:
        raise ValueError(f"unknown hostile kind {kind!r}; known: {HOSTILE_KINDS}")
    return path


def _vm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _release_fifos(paths: Iterable[Path]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader waiting (ENXIO) or not a FIFO: nothing to release
            continue
        os.close(fd)


def bounded_call(fn: Callable[[], Any], *, timeout_s: float = 30.0, headroom: int = 1 << 30,
                 fifos: Iterable[str | os.PathLike[str]] = ()) -> BaseException | None:
    """Run ``fn()`` under a memory limit and a timeout; return what it raised (None if it returned).

    Raises AssertionError when ``fn`` does not finish within ``timeout_s`` (a hang) or hits the memory
    limit (MemoryError: an unbounded read)."""
    box: dict[str, BaseException | None] = {"exc": None}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed back to the test
            box["exc"] = exc

    thread = threading.Thread(target=run, daemon=True, name="bounded_call")
    with _address_space_limit(headroom):
        thread.start()
        thread.join(timeout_s)
        hung = thread.is_alive()
        if hung:
            _release_fifos([Path(p) for p in fifos])
            thread.join(5.0)
    if hung:
        raise AssertionError(f"{fn!r} did not finish within {timeout_s} s (a read that blocks forever?)")
    if isinstance(box["exc"], MemoryError):
        raise AssertionError(f"{fn!r} exceeded the memory limit (an unbounded read?)") from box["exc"]
    return box["exc"]


class _address_space_limit:  # noqa: N801 - used as a context manager
    """Lower the soft RLIMIT_AS to current size + headroom; restored on exit (soft limits may rise again)."""

    def __init__(self, headroom: int) -> None:
        self.headroom = headroom
        self.before: tuple[int, int] | None = None

    def __enter__(self) -> None:
        size = _vm_bytes()
        if resource is None or size is None:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + self.headroom
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or limit < soft:
            self.before = (soft, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            resource.setrlimit(resource.RLIMIT_AS, self.before)
