"""The one builder of flashrt's native libraries: the csrc CUDA kernels (`flashrt.ops.csrc`, nvcc) and
the native CPU kernels (`flashrt.ops.csrc_cpu`, the C compiler) differ only in their `Recipe`.

    recipe = Recipe("flashrt_cpu", "native CPU kernels", "the C compiler", sources, commands)
    path = build(recipe, out_dir, cc, fields, timeout_s)          # compile (or reuse) + sha256 sidecar
    lib = load(recipe, folder, cc, fields, bind, timeout_s)       # verified load, built on a miss

A library's file is ``<library>-<key>.so``, the key a digest of its ``fields`` (everything it depends
on: the sources' digest `sources_digest`, the compiler's version, flags, target, ABI); the trust rules
of the cache folder and the file (`flashrt.ops.native`) apply to both alike.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrt.ops import native
from flashrt.ops.native import Library

log = logging.getLogger(__name__)

__all__ = ["Recipe", "build", "library_name", "load", "load_compiled", "sources_digest"]


@dataclass(frozen=True)
class Recipe:
    """How one native library is built: its name (the file's stem, its ``library`` key field), what it
    is called in messages, the compiler's name in a failure, its sources, and ``commands(compiler,
    fields)``: the compile commands tried in order (the first that succeeds is kept; `native.OUT` is the
    output file)."""

    library: str
    what: str
    tool: str
    sources: Callable[[], list[Path]]
    commands: Callable[[str, dict[str, Any]], Sequence[Sequence[str]]]


def sources_digest(paths: Sequence[Path], headers: Sequence[Path] = ()) -> str:
    """sha256 over the names and contents of ``paths``, then of the ``headers`` not among them."""
    digest = hashlib.sha256()
    for path in [*paths, *(h for h in headers if h not in paths)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def library_name(recipe: Recipe, fields: dict[str, Any]) -> str:
    return f"{recipe.library}-{native.key_digest(fields)}.so"


def build(recipe: Recipe, out_dir: Path, compiler: str, fields: dict[str, Any], timeout_s: float) -> Path:
    """``out_dir/<library>-<key>.so`` compiled by the first of the recipe's commands that succeeds,
    atomically, with its sha256 sidecar; an existing verified file of the same key is reused. BuildError
    when none succeeds or one runs past ``timeout_s``."""
    target = Path(out_dir) / library_name(recipe, fields)
    try:
        native.read_verified(target, fields)
        return target
    except native.Untrusted:
        pass
    native.compile_library(target, recipe.commands(compiler, fields), recipe.tool, fields, timeout_s)
    log.info("built the %s: %s", recipe.what, target)
    return target


def load(recipe: Recipe, folder: Path, compiler: str, fields: dict[str, Any],
         bind: Callable[[ctypes.CDLL], bool], timeout_s: float, build_missing: bool = True) -> Library | None:
    """The library of ``fields`` from ``folder``, verified and loaded, built there on a miss (with
    ``build_missing``); None where it cannot be (the reason logged)."""
    rebuild = (lambda out_dir: build(recipe, out_dir, compiler, fields, timeout_s)) if build_missing else None
    return native.load_library(folder, library_name(recipe, fields), fields, rebuild, bind, recipe.what)


def load_compiled(recipe: Recipe, folder: Path, compiler: str | None, missing: str,
                  key_fields: Callable[[str, float], dict[str, Any]], bind: Callable[[ctypes.CDLL], bool],
                  timeout_s: float, build_missing: bool = True) -> Library | None:
    """`load` for a library the machine's own ``compiler`` builds. Without one nothing loads (``missing``
    said once at WARNING): a cached library's key (this CPU, the compiler's version) cannot be checked,
    and one built for another CPU of a shared cache could fault. A compiler whose ``--version`` fails:
    None, with a warning."""
    if compiler is None:
        native.warn_once(missing)
        return None
    try:
        fields = key_fields(compiler, timeout_s)
    except native.BuildError as exc:
        log.warning("%s off, the reference forms run instead (slower): %s", recipe.what, exc)
        return None
    return load(recipe, folder, compiler, fields, bind, timeout_s, build_missing)
