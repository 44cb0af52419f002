"""Content digests of tensors and files: the identity of checkpoint data in every cache key.

Two entry points:
- `tensor_digest(tensors)` hashes a name -> tensor mapping (names, dtypes, shapes and raw bytes, streamed
  in chunks, so a lazily loaded checkpoint is never materialised whole and a GPU tensor is copied to the
  host one chunk at a time).
- `file_digest(path)` hashes a file's bytes (or, for a directory, every regular file below it). The result
  is memoized in a small JSON file keyed on (realpath, size, mtime_ns, inode): a 6 GB checkpoint is read
  once, not at every start. Any change of size, mtime or inode (an edit, a copy, a swap by rename)
  invalidates the memo entry. Known blind spot: an in-place rewrite that keeps the size and forges the
  mtime is not seen; pass `memo=False` where that matters.

Digests are SHA-256 hex strings. Raw bytes are hashed in the machine's native byte order (little-endian
on every platform flashrt supports).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from flashrt.errors import CheckpointError
from flashrt.io.atomic import atomic_write_text
from flashrt.io.files import open_regular, read_text
from flashrt.paths import user_cache_dir

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
MEMO_FILENAME = "file-digests.json"
MEMO_MAX_ENTRIES = 512
_MEMO_VERSION = 1


def tensor_digest(tensors: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> str:
    """SHA-256 over names (sorted), dtypes, shapes and raw bytes of every tensor, streamed in chunks."""
    h = hashlib.sha256(b"flashrt.tensor_digest.v1\0")
    for name in sorted(tensors):
        _update_tensor(h, name, tensors[name], chunk_bytes)
    return h.hexdigest()


def _update_tensor(h, name: str, tensor: torch.Tensor, chunk_bytes: int) -> None:
    flat = _as_bytes(tensor)
    header = json.dumps([name, str(tensor.dtype), list(tensor.shape), flat.numel()]).encode()
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    for start in range(0, flat.numel(), chunk_bytes):
        h.update(flat[start:start + chunk_bytes].cpu().numpy().data)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's bytes in row-major order (copies only if non-contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def default_memo_dir() -> Path:
    """Folder of the default digest memo: the user cache dir of flashrt."""
    return user_cache_dir()


def file_digest(path: str | os.PathLike, memo: bool = True, memo_dir: str | os.PathLike | None = None,
                chunk_bytes: int = CHUNK_BYTES) -> str:
    """SHA-256 of a file's bytes, or of a directory's files (relative names + contents), memoized.

    `memo_dir` holds the memo file (default `default_memo_dir()`); `memo=False` always reads the data.
    """
    real = Path(os.path.realpath(path))
    if not real.exists():
        raise FileNotFoundError(f"cannot digest {path}: no such file or directory")
    if real.is_dir():
        return _tree_digest(real, memo, memo_dir, chunk_bytes)
    if not memo:
        return _hash_file(real, chunk_bytes)
    return _memoized(real, Path(memo_dir) if memo_dir is not None else default_memo_dir(), chunk_bytes)


def _tree_digest(root: Path, memo: bool, memo_dir, chunk_bytes: int) -> str:
    h = hashlib.sha256(b"flashrt.tree_digest.v1\0")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root)))
    for p in files:
        rel = p.relative_to(root).as_posix()
        h.update(json.dumps([rel, file_digest(p, memo, memo_dir, chunk_bytes)]).encode() + b"\n")
    return h.hexdigest()


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _hash_file(path: Path, chunk_bytes: int) -> str:
    h = hashlib.sha256()
    with open_regular(path, "file to digest") as f:
        left = os.fstat(f.fileno()).st_size  # capped at the size when opened
        while left > 0 and (chunk := f.read(min(chunk_bytes, left))):
            left -= len(chunk)
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _memoized(real: Path, memo_dir: Path, chunk_bytes: int) -> str:
    memo_path = memo_dir / MEMO_FILENAME
    before = _stat_key(real)
    entry = _read_memo(memo_path).get(str(real))
    if entry is not None and all(entry.get(k) == v for k, v in before.items()):
        return entry["digest"]
    digest = _hash_file(real, chunk_bytes)
    if _stat_key(real) == before:
        _remember(memo_path, str(real), {**before, "digest": digest})
    else:
        log.warning("%s changed while it was being hashed; digest not memoized", real)
    return digest


def _read_memo(memo_path: Path) -> dict:
    """The memo's entries; an unreadable or foreign memo is treated as empty (it is only a cache)."""
    if not os.path.lexists(memo_path):
        return {}
    try:
        data = json.loads(read_text(memo_path, "digest memo"))
    except (CheckpointError, ValueError) as err:
        log.warning("ignoring unreadable digest memo %s: %s", memo_path, err)
        return {}
    if not isinstance(data, dict) or data.get("version") != _MEMO_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _remember(memo_path: Path, key: str, entry: dict) -> None:
    """Add one entry (read-modify-write, atomic replace). A lost race only costs a later re-hash."""
    entries = _read_memo(memo_path)
    entries.pop(key, None)
    entries[key] = entry
    while len(entries) > MEMO_MAX_ENTRIES:
        entries.pop(next(iter(entries)))
    try:
        _atomic_write_text(memo_path, json.dumps({"version": _MEMO_VERSION, "entries": entries}, indent=1))
    except OSError as err:
        log.warning("could not write digest memo %s: %s", memo_path, err)


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_write_text(path, text, tmp_prefix=f".tmp-{path.name}.")
