"""Native libraries flashrt compiles and loads (the csrc CUDA and CPU kernels): the one place for the
rules that keep a cache folder from running code flashrt did not build, and for running compilers.

    fields = {...}                                  # everything the library depends on (its cache key)
    lib = load_library(folder, name, fields, build, bind, "native CPU kernels")

Trust (checked before any ``dlopen``; a file that fails a check is never loaded):

- The cache folder is a real directory owned by this user and writable by nobody else; every folder
  above it is owned by this user or root and writable by nobody else unless sticky (``/tmp``).
  Otherwise another user could put files in it, sidecars included, so nothing in it is used: the
  library is built in a fresh private temporary folder, loaded from there and deleted (a warning says
  which folder to fix; nothing is cached until then).
- The library is a regular file (not a symlink), owned by this user, writable by nobody else, and its
  bytes have the sha256 recorded at build time in the sidecar ``<library>.sha256`` (JSON, written
  atomically, same checks), which also holds the key fields it was built for. The bytes are read once,
  hashed, and those very bytes are loaded (copied into a sealed memory file, `os.memfd_create`, or
  where that cannot be executed a private temporary copy): a swap between check and load cannot slip
  in another library.
- A refused library is deleted and rebuilt where a compiler is, with a warning that says why; without
  a compiler it is not loaded and the caller's torch/reference path runs.

Compilers: every compiler process (``--version`` included) runs with a timeout in its own process
group, killed as a whole on timeout (nvcc's children too); a failure or a timeout is a `BuildError`,
which `load_library` turns into a warning and None (the reference path). Build outputs are written to
temporary names ``.build-<host>-<pid>-*`` beside the target and removed on any failure; those left by
a build that was killed (its process gone, or older than a day) are removed by the next build there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrt.io.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

__all__ = ["OUT", "BuildError", "Library", "Untrusted", "check_folder", "compile_library", "key_digest",
           "load_library", "make_private_folder", "read_own_file", "read_verified", "run_tool",
           "tool_version", "warn_once"]

OUT = "{out}"  # the output-file argument of a `compile_library` command
SIDECAR = ".sha256"
SIDECAR_FORMAT = "flashrt-native"
TMP_PREFIX = ".build-"
LIBRARY_LIMIT = 1 << 30
SIDECAR_LIMIT = 1 << 20
STALE_AGE_S = 24 * 3600
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_OPEN_FLAGS = os.O_RDONLY | sum(getattr(os, flag, 0) for flag in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"))
_TEMP_NAME = re.compile(r"^\.build-([0-9a-f]{8})-(\d+)-")
_WARNED: set[str] = set()
_MEMFDS: list[int] = []  # memory files of the loaded libraries (`_dlopen_memfd`)


class Untrusted(Exception):
    """A folder or file that must not be used; the message says why."""


class BuildError(RuntimeError):
    """A compiler that is missing, fails, or does not finish in time; the message says which."""


@dataclass
class Library:
    """A loaded native library: the ctypes handle and the cache file its bytes came from."""

    path: Path
    handle: ctypes.CDLL


def warn_once(message: str) -> None:
    """Log ``message`` at WARNING the first time in this process (later: DEBUG)."""
    log.log(logging.DEBUG if message in _WARNED else logging.WARNING, message)
    _WARNED.add(message)


def key_digest(fields: Mapping[str, Any]) -> str:
    """The file-name key of a library: 20 hex digits of the sha256 of its fields' canonical JSON."""
    return hashlib.sha256(_canonical(fields).encode()).hexdigest()[:20]


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------------------ folders


def check_folder(folder: str | os.PathLike[str]) -> None:
    """Untrusted unless ``folder`` and the folders above it follow the rules (module docstring)."""
    folder = Path(os.path.abspath(folder))
    st = _lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"cache folder {folder} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"cache folder {folder} is not a directory")
    if st.st_uid != os.geteuid():
        raise Untrusted(f"cache folder {folder} belongs to uid {st.st_uid}, not to this user "
                        f"({os.geteuid()})")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise Untrusted(f"cache folder {folder} is writable by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):o}; `chmod go-w {folder}` fixes it)")
    real = Path(os.path.realpath(folder))
    for parent in (*folder.parents, *(real.parents if real != folder else ())):
        _check_parent(parent, folder)


def _check_parent(parent: Path, folder: Path) -> None:
    st = _lstat(parent)
    if st.st_uid not in (os.geteuid(), 0):
        raise Untrusted(f"{parent} (above the cache folder {folder}) belongs to uid {st.st_uid}")
    sticky = st.st_mode & stat.S_ISVTX
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & _WRITABLE_BY_OTHERS and not sticky:
        raise Untrusted(f"{parent} (above the cache folder {folder}) is writable by other users "
                        f"(mode {stat.S_IMODE(st.st_mode):o})")


def _lstat(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise Untrusted(f"{path} cannot be checked: {exc.strerror or exc}") from None


def make_private_folder(folder: str | os.PathLike[str]) -> None:
    """Create ``folder`` and any missing folder above it with mode 0700 (whatever the umask)."""
    missing, path = [], Path(os.path.abspath(folder))
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


# --------------------------------------------------------------------------------------------- files


def read_verified(path: Path, fields: Mapping[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
    """(bytes, key fields) of the library ``path`` after the file checks and the sidecar's sha256; with
    ``fields``, its recorded fields must be those. Untrusted otherwise."""
    data = read_own_file(path, "library", LIBRARY_LIMIT)
    meta = _read_sidecar(path)
    if meta.get("sha256") != hashlib.sha256(data).hexdigest() or meta.get("bytes") != len(data):
        raise Untrusted(f"library {path}: its bytes are not the ones flashrt built (sha256 differs from its "
                        "sidecar's: replaced or corrupted)")
    if fields is not None and meta["fields"] != dict(fields):
        stored = meta["fields"]
        differ = sorted(k for k in set(stored) | set(fields) if stored.get(k) != fields.get(k))
        raise Untrusted(f"library {path} was built for other {', '.join(differ)}")
    return data, meta["fields"]


def _read_sidecar(path: Path) -> dict[str, Any]:
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        meta = json.loads(read_own_file(sidecar, "sidecar", SIDECAR_LIMIT))
    except (ValueError, UnicodeDecodeError):
        raise Untrusted(f"sidecar {sidecar} is not flashrt's JSON") from None
    if not (isinstance(meta, dict) and meta.get("format") == SIDECAR_FORMAT
            and isinstance(meta.get("fields"), dict)):
        raise Untrusted(f"sidecar {sidecar} is not a {SIDECAR_FORMAT} record")
    return meta


def read_own_file(path: Path, what: str, limit: int) -> bytes:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise Untrusted(_open_problem(path, what, exc)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{what} {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise Untrusted(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & _WRITABLE_BY_OTHERS:
            raise Untrusted(f"{what} {path} is writable by other users")
        if st.st_size > limit:
            raise Untrusted(f"{what} {path} is {st.st_size} bytes, more than a {what} can be")
        os.set_blocking(fd, True)
        return f.read(st.st_size)


def _open_problem(path: Path, what: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP or os.path.islink(path):
        return f"{what} {path} is a symlink"
    if isinstance(exc, FileNotFoundError):
        return f"{what} {path} is missing"
    return f"{what} {path} cannot be opened: {exc.strerror or exc}"


def _remove(path: Path) -> None:
    """Delete a file or link (never what a link points to) or a folder tree, if there."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _publish(tmp: Path, target: Path, fields: Mapping[str, Any]) -> None:
    """The sidecar of ``tmp``'s bytes, then ``tmp`` renamed to ``target`` (both atomic)."""
    os.chmod(tmp, 0o700)
    data = read_own_file(tmp, "library", LIBRARY_LIMIT)
    meta = {"format": SIDECAR_FORMAT, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "fields": dict(fields)}
    sidecar = target.with_name(target.name + SIDECAR)
    atomic_write_bytes(sidecar, _canonical(meta).encode(), tmp_prefix=_temp_prefix())
    os.replace(tmp, target)


# ----------------------------------------------------------------------------------------- compilers


def run_tool(cmd: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; BuildError when it cannot start or runs past
    ``timeout_s`` (the whole group is killed). A non-zero exit is returned, not raised."""
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        raise BuildError(f"{cmd[0]} cannot be run: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise BuildError(f"{cmd[0]} did not finish within {timeout_s:g} s and was killed "
                         f"({' '.join(cmd)})") from None
    except BaseException:
        _kill(proc)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def first_on_path(names: Sequence[str]) -> str | None:
    """The first of ``names`` found on PATH (a compiler's usual names, in order); None for none."""
    return next(filter(None, map(shutil.which, names)), None)


def tool_version(exe: str, timeout_s: float) -> str:
    """``exe --version``'s output; BuildError when it fails or hangs (a broken compiler)."""
    done = run_tool([exe, "--version"], timeout_s)
    if done.returncode != 0:
        raise BuildError(f"{exe} --version failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return done.stdout


def compile_library(target: Path, commands: Sequence[Sequence[str]], compiler: str,
                    fields: Mapping[str, Any], timeout_s: float) -> Path:
    """Run the first of ``commands`` that succeeds, its `OUT` argument a temporary file beside
    ``target``; publish that as ``target`` with its sidecar. BuildError with the last command's output
    when none succeeds (nothing left behind, on any failure)."""
    folder = target.parent
    make_private_folder(folder)
    remove_stale_temps(folder)
    fd, name = tempfile.mkstemp(prefix=_temp_prefix(), suffix=".so", dir=folder)
    os.close(fd)
    tmp = Path(name)
    try:
        for command in commands:
            cmd = [name if arg == OUT else arg for arg in command]
            done = run_tool(cmd, timeout_s)
            if done.returncode == 0:
                _publish(tmp, target, fields)
                return target
        raise BuildError(f"{compiler} failed ({' '.join(cmd)}):\n{done.stderr.strip()[-4000:]}")
    finally:
        _remove(tmp)


def _temp_prefix() -> str:
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"{TMP_PREFIX}{host}-{os.getpid()}-"


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temporary files of builds in ``folder`` that cannot finish any more: their process
    (on this host) is gone, or they are older than `STALE_AGE_S`. Returns what was removed."""
    here = _temp_prefix()[len(TMP_PREFIX):].split("-")[0]
    stale = [p for p in folder.glob(f"{TMP_PREFIX}*") if _is_stale(p, here)]
    for path in stale:
        _remove(path)
    return stale


def _is_stale(path: Path, host: str) -> bool:
    match = _TEMP_NAME.match(path.name)
    with contextlib.suppress(OSError):
        if time.time() - os.lstat(path).st_mtime > STALE_AGE_S:
            return True
    return match is not None and match.group(1) == host and not _alive(int(match.group(2)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


# ------------------------------------------------------------------------------------------- loading


def _dlopen(data: bytes, path: Path, scratch: Path) -> ctypes.CDLL:
    """Load exactly ``data`` (the verified bytes of ``path``): from a sealed memory file, else from a
    private temporary copy in ``scratch`` (deleted once loaded)."""
    if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
        try:
            return _dlopen_memfd(data, path.name)
        except OSError as exc:  # e.g. memory files not executable here (vm.memfd_noexec)
            log.debug("loading %s from a memory file failed (%s); using a private copy", path, exc)
    folder = tempfile.mkdtemp(prefix=_temp_prefix(), dir=scratch)
    try:
        copy = Path(folder) / path.name
        copy.write_bytes(data)
        return ctypes.CDLL(str(copy))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _dlopen_memfd(data: bytes, name: str) -> ctypes.CDLL:
    import fcntl

    fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        seals = sum(getattr(fcntl, f"F_SEAL_{s}", 0) for s in ("SHRINK", "GROW", "WRITE", "SEAL"))
        if seals and hasattr(fcntl, "F_ADD_SEALS"):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        handle = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _MEMFDS.append(fd)  # kept open: the loader knows a library by its name, and a reused fd number
    return handle       # would make the next library's name that of this one


def open_verified(path: Path, fields: Mapping[str, Any] | None, bind: Callable[[ctypes.CDLL], bool],
                  scratch: Path) -> Library | None:
    """The library ``path`` loaded from its verified bytes; None when ``bind`` rejects it (another ABI);
    Untrusted when a check fails (nothing was loaded)."""
    data, _ = read_verified(path, fields)
    try:
        handle = _dlopen(data, path, scratch)
    except OSError as exc:
        log.warning("%s could not be loaded: %s", path, exc)
        return None
    return Library(path, handle) if bind(handle) else None


def load_library(folder: Path, name: str, fields: Mapping[str, Any], build: Callable[[Path], Path] | None,
                 bind: Callable[[ctypes.CDLL], bool], what: str) -> Library | None:
    """``folder/name`` verified and loaded, or (``build`` given) rebuilt with ``build(out_dir)`` and
    loaded; None where it cannot be (the reason logged as a warning: the caller's fallback runs)."""
    try:
        return _load_or_build(Path(folder), name, fields, build, bind, what)
    except (BuildError, OSError) as exc:
        log.warning("%s off, the reference forms run instead (slower): %s", what, exc)
        return None
    except Untrusted as exc:
        log.warning("%s off, the reference forms run instead (slower): refused %s", what, exc)
        return None


def _load_or_build(folder: Path, name: str, fields: Mapping[str, Any], build: Callable[[Path], Path] | None,
                   bind: Callable[[ctypes.CDLL], bool], what: str) -> Library | None:
    if build is not None and not os.path.lexists(folder):
        make_private_folder(folder)
    try:
        check_folder(folder)
    except Untrusted as exc:
        if not os.path.lexists(folder) and build is None:
            return None
        return _build_privately(exc, fields, build, bind, what)
    path = folder / name
    if os.path.lexists(path) or os.path.lexists(path.with_name(name + SIDECAR)):
        try:
            lib = open_verified(path, fields, bind, folder)
        except Untrusted as exc:
            log.warning("%s: refusing the cached %s; %s", what, exc,
                        "rebuilding it" if build else "not loading it (no compiler to rebuild it)")
            lib = None
        if lib is not None:
            return lib
        _remove(path), _remove(path.with_name(name + SIDECAR))
    if build is None:
        return None
    return open_verified(build(folder), fields, bind, folder)


def _build_privately(reason: Untrusted, fields: Mapping[str, Any], build: Callable[[Path], Path] | None,
                     bind: Callable[[ctypes.CDLL], bool], what: str) -> Library | None:
    """Build into a fresh private temporary folder, load, delete it: the cache folder is not safe."""
    if build is None:
        raise reason
    log.warning("%s: not using the cache folder (%s); building in a private temporary folder instead, "
                "nothing is cached until it is fixed", what, reason)
    scratch = Path(tempfile.mkdtemp(prefix="flashrt-native-"))
    try:
        return open_verified(build(scratch), fields, bind, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def find_verified(folder: Path, pattern: str, match: Callable[[Mapping[str, Any]], bool],
                  bind: Callable[[ctypes.CDLL], bool], what: str) -> Library | None:
    """The first library in ``folder`` named like ``pattern`` whose recorded fields ``match`` and that
    passes every check (no compiler to compute the exact key); refused ones are skipped with a warning."""
    try:
        check_folder(folder)
    except Untrusted as exc:
        if os.path.lexists(folder):
            log.warning("%s: not using the cache folder (%s)", what, exc)
        return None
    for path in sorted(folder.glob(pattern)):
        try:
            fields = _read_sidecar(path)["fields"]
            if not match(fields):
                continue
            lib = open_verified(path, fields, bind, folder)
        except Untrusted as exc:
            log.warning("%s: refusing the cached %s", what, exc)
            continue
        if lib is not None:
            return lib
    return None
