"""Checkpoints by hub id: ``load_policy("lerobot/pi05_base")`` finds the folder in the local Hugging
Face cache.

A path that exists is used as it is. Otherwise a string of the form ``owner/name`` (optionally
``owner/name@revision``) is looked up with `huggingface_hub` (an optional dependency:
``pip install 'flashrt[hub]'``) in its local cache only, unless the caller allows downloads
(``allow_download=True``); `huggingface_hub` itself honours ``HF_HUB_OFFLINE`` and ``HF_HOME`` /
``HF_HUB_CACHE``, so flashrt reads no environment variable of its own. Anything else, or an id that
is not in the cache, is a `CheckpointError` saying what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from flashrt.errors import CheckpointError

__all__ = ["resolve_checkpoint", "looks_like_hub_id", "hub_file"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and ".." not in value


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError("loading by hub id needs the `huggingface_hub` package "
                              "(pip install 'flashrt[hub]'), or pass a local folder") from None
    return huggingface_hub


def resolve_checkpoint(path: str | Path, allow_download: bool = False,
                       cache_dir: str | Path | None = None) -> Path:
    """The local folder of `path`: itself when it exists, else the hub cache's snapshot of the id."""
    local = Path(path)
    if local.exists() or not isinstance(path, str) or not looks_like_hub_id(path):
        return local
    repo_id, _, revision = path.partition("@")
    hub = _hub()
    try:
        folder = hub.snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir,
                                       local_files_only=not allow_download)
    except Exception as exc:  # huggingface_hub raises several types (offline, missing, auth)
        how = ("" if allow_download else "; it is not in the local Hugging Face cache: download it "
               f"first (`hf download {repo_id}`) or pass allow_download=True")
        raise CheckpointError(f"{path}: not a local folder, and the hub id could not be resolved{how} "
                              f"({type(exc).__name__})") from None
    return Path(folder)


def hub_file(repo_id: str, filename: str, cache_dir: str | Path | None = None) -> Path | None:
    """A file of `repo_id` already in the local hub cache (never downloads); None when absent or when
    `huggingface_hub` is not installed."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    found = huggingface_hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
    return Path(found) if isinstance(found, str) else None
