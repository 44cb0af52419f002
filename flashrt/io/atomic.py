"""Atomic file writes: a temp file in the destination folder, fsync, then `os.replace`.

Readers see either the old file or the whole new one, never a half-written file, even with several
writers (threads or processes) racing on the same path. A failed write leaves no temp file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, payload: bytes, tmp_prefix: str = ".tmp-") -> None:
    """Write `payload` to `path` atomically. Temp files are named `<tmp_prefix>...partial`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=tmp_prefix, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, tmp_prefix: str = ".tmp-") -> None:
    atomic_write_bytes(path, text.encode("utf-8"), tmp_prefix)
