"""Reading untrusted files: regular files only, reads capped at the file's size, paths kept in their folder.

Readers of files that come from outside (weights, configs, statistics, tokenizers, calibration entries,
profiles, model cards, traces) use these functions, so three promises hold in one place:

- Only regular files are read, after resolving links. A character device (``/dev/zero``, which would
  grow memory without bound), a FIFO (which would block ``open()`` until a writer comes, forever), a
  socket or a directory is refused with a typed error naming what the file was for. The file is opened
  with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a FIFO never blocks and a
  file swapped between a check and the open is still checked.
- Every read is capped at the size ``fstat`` reported (a file growing while it is read is cut there)
  and, for configs, at an absolute ``limit`` (a 2 GB "config.json" is refused before it is read).
- A file name found inside another file (a shard index's shard names, a processor's ``state_file``, an
  openpi ``asset_id``) is resolved with `resolve_inside` and must stay inside its folder after links
  are resolved: absolute paths, ``..`` and symlinks pointing out are a CheckpointError naming the field.

Errors: each function takes ``error``, the exception class to raise (CheckpointError by default;
ConfigError for profiles and cards, a cache's own miss type for cache entries). Its message names the
file and what it was for. Libraries that insist on a path (``safetensors.safe_open``'s memory map,
``torch.load(mmap=True)``, sentencepiece) get the path after `check_regular`, which applies the same
rules to the resolved path.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from flashrt.errors import CheckpointError, ConfigError

__all__ = ["CONFIG_LIMIT", "TOKENIZER_LIMIT", "check_regular", "open_regular", "read_bytes_capped",
           "read_text", "read_json", "read_toml", "read_yaml", "read_tokenizer_json", "resolve_inside"]

CONFIG_LIMIT = 64 << 20  # bytes: no JSON / YAML / TOML config or statistics file flashrt reads is near this
TOKENIZER_LIMIT = 64 << 20  # bytes: Llama-3's tokenizer.json is 9 MB, the largest released ones ~35 MB
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"))

ErrorType = type[Exception]


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path: Path, what: str, mode: int, error: ErrorType) -> Exception:
    real = os.path.realpath(path)
    via = f" (a link to {real})" if real != os.path.abspath(path) else ""
    return error(f"{what} {path}{via} is {_kind(mode)}; flashrt reads only regular files. "
                 "Point it at the real file.")


def _os_error(path: Path, what: str, exc: OSError, error: ErrorType) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return error(f"{what} {path} not found")
    if isinstance(exc, PermissionError):
        return error(f"{what} {path} is not readable (permission denied)")
    return error(f"{what} {path} cannot be opened: {exc.strerror or exc}")


def check_regular(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError) -> Path:
    """``path`` if it is (after links) a readable regular file, else ``error``; for libraries that open
    files themselves. Opening it here, non-blocking, is what proves it (and never hangs on a FIFO)."""
    with open_regular(path, what, error):
        return Path(path)


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError
                 ) -> Iterator[BinaryIO]:
    """A binary file object of ``path``, which must be (after links) a regular file. Never blocks."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        raise _os_error(path, what, exc, error) from None
    except ValueError:  # a NUL byte in the name
        raise error(f"{what} {str(path)!r} is not a usable file name (it holds a NUL byte)") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, what, mode, error)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def read_bytes_capped(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError,
                      limit: int | None = None) -> bytes:
    """The bytes of a regular file, at most its size when opened; larger than ``limit``: ``error``."""
    with open_regular(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise error(f"{what} {path} is {size} bytes, more than the {limit} this kind of file may have")
        try:
            return f.read(size)
        except OSError as exc:
            raise _os_error(Path(path), what, exc, error) from None


def read_text(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError,
              limit: int | None = CONFIG_LIMIT) -> str:
    """A UTF-8 text file (regular, capped at ``limit``); undecodable bytes are ``error``."""
    data = read_bytes_capped(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start}); is it the right file?") from None


def read_json(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError,
              limit: int | None = CONFIG_LIMIT, expect: type = dict) -> Any:
    """Parsed JSON whose top level is an ``expect`` (dict by default); anything else is ``error``."""
    text = read_text(path, what, error, limit)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} {path} is not valid JSON ({exc})") from None
    return _expect(data, expect, path, what, error)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (NaN and Infinity are refused)")


def read_toml(path: str | os.PathLike[str], what: str, error: ErrorType = ConfigError,
              limit: int | None = CONFIG_LIMIT) -> dict[str, Any]:
    """Parsed TOML (a table); invalid TOML is ``error`` naming the file."""
    text = read_text(path, what, error, limit)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise error(f"{what} {path} is not valid TOML ({exc})") from None


def read_yaml(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError,
              limit: int | None = CONFIG_LIMIT, expect: type = dict) -> Any:
    """``yaml.safe_load`` of a regular file (no object construction); top level must be an ``expect``."""
    import yaml

    text = read_text(path, what, error, limit)
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise error(f"{what} {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    return _expect(data, expect, path, what, error)


def read_tokenizer_json(path: str | os.PathLike[str], what: str, error: ErrorType = CheckpointError,
                        limit: int | None = None) -> Any:
    """A Hugging Face ``tokenizers.Tokenizer`` from a ``tokenizer.json`` read as a regular file of at most
    ``limit`` bytes (default `TOKENIZER_LIMIT`); one that does not parse is ``error`` naming the file
    (``Tokenizer.from_file`` would open a FIFO, read /dev/zero and raise a bare Exception)."""
    from tokenizers import Tokenizer

    text = read_text(path, what, error, TOKENIZER_LIMIT if limit is None else limit)
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises a plain Exception
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{what} {path} is not a tokenizers JSON file ({detail})") from None


def _expect(data: Any, expect: type, path: Any, what: str, error: ErrorType) -> Any:
    if not isinstance(data, expect):
        raise error(f"{what} {path}: the top level must be a {_type_name(expect)}, "
                    f"got {type(data).__name__}")
    return data


def _type_name(t: type) -> str:
    return {dict: "mapping (JSON object)", list: "list"}.get(t, t.__name__)


def resolve_inside(folder: str | os.PathLike[str], name: Any, field: str,
                   error: ErrorType = CheckpointError) -> Path:
    """``folder / name`` resolved (links included), which must stay inside ``folder``.

    ``name`` comes from a file (``field`` says which key of which file), so it must be a non-empty
    relative string without NUL that does not climb out with ``..``; and after links are resolved the
    target must lie inside the folder. An absolute path, ``..`` leading out, or a symlink pointing out
    is ``error`` naming the field. One exception, the Hugging Face cache: in a ``snapshots/<commit>``
    folder every file is a link into the repository's ``blobs``, so for a folder in or below a
    snapshot, targets in that ``blobs`` are inside too. The returned path need not exist.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"{field}: expected a file name inside {folder}, got {name!r}")
    if os.path.isabs(name) or Path(name).is_absolute():
        raise error(f"{field}: {name!r} is an absolute path; it must name a file inside {folder}")
    if os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise error(f"{field}: {name!r} leads out of {folder} with '..'; it must name a file inside it")
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(root / name))
    if not any(target == r or r in target.parents for r in _roots(root)):
        raise error(f"{field}: {name!r} resolves to {target}, outside {root}; a checkpoint may only "
                    "refer to files inside its own folder")
    return target


def _roots(root: Path) -> tuple[Path, ...]:
    """The folder, plus its repository's blob store when it is (inside) a Hugging Face cache snapshot."""
    for snapshot in (root, *root.parents):
        if snapshot.parent.name == "snapshots" and (snapshot.parent.parent / "blobs").is_dir():
            return root, snapshot.parent.parent / "blobs"
    return (root,)
