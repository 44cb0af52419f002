"""Where flashrt keeps files of its own: one user cache folder, with a subfolder per use.

Every default location is derived here, so there is one place to read (and one to change). Callers
accept an explicit folder argument, which always wins over these defaults; no environment variable is
read by flashrt itself (platformdirs follows the platform's conventions, e.g. XDG_CACHE_HOME).
"""

from __future__ import annotations

from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    """`<user cache dir>/flashrt[/parts...]`, e.g. user_cache_dir("calibration"). Without platformdirs
    (a bare GPU box) the plain POSIX default `~/.cache/flashrt` is used."""
    try:
        from platformdirs import user_cache_dir as platform_cache_dir
    except ImportError:
        return Path.home().joinpath(".cache", "flashrt", *parts)
    return Path(platform_cache_dir("flashrt")).joinpath(*parts)
