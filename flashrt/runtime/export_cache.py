"""Export cache: one ONNX model per ExportKey, one TensorRT engine per EngineKey, each verified on every load
(the calibration cache's guarantees).

Ownership and validity (house style #9):
- Owner: the `ExportCache` folder (default `flashrt.paths.user_cache_dir("onnx")`, or the `root`
  argument; no environment variable is read). Entries are shared by every process of the user; any of
  them may add or replace entries at any time.
- Valid for exactly one `ExportKey`: digests of the weights (every constant the step reads) and of the
  program (its ops and scalar arguments, which carry the model config and every frozen Python value),
  the bucket shapes and dtypes of its buffers, the precision (dtypes), exporter versions (torch,
  onnxscript, onnx, opset), runtime version (onnxruntime), device arch and the export scheme.
- Valid for exactly one `EngineKey` (a TensorRT engine): the fields above that describe the step, the
  digest of the ONNX model it was built from, the builder options (precision mode, optimization level,
  workspace) and the calibration scales' digest, the TensorRT version, the device arch (compute
  capability, "sm90") and the GPU's name: an engine is only valid on the TensorRT build and GPU it was
  built for, and TensorRT itself may or may not notice a stale one.
- Running a model exported for other weights or shapes gives wrong outputs silently, so the key fields
  are stored inside the file and compared field by field on load, and the model bytes carry a digest.
  No file, a corrupt header, a truncated file, edited model bytes, an entry copied under another key:
  each is a miss (logged, returned as a reason) and the model is exported again, never used.
- A TensorRT engine is code the runtime deserializes, so the native libraries' trust rules apply
  (`flashrt.ops.native`): the folder must be owned by this user and writable by nobody else (and
  the folders above it, unless sticky), an entry must be a regular file (not a symlink) owned by this
  user and writable by nobody else. Anything else is a miss with the reason, and nothing is stored in
  a folder that fails them (the model is exported for this process only). A folder flashrt creates is
  created with mode 0700.

File layout: `<model>-<key digest[:16]>.onnxrt` (ONNX) or `.trtengine` (engine) = 8-byte little-endian
header length, the header JSON {format, format_version, key, key_digest, payload_digest, payload_bytes,
created, flashrt_version}, then the ONNX model (or serialized engine) bytes. The two kinds share one
folder and one reader; the header's `format` names the kind, and a file of one kind under the other's
suffix is refused. Writes are atomic (temp file, fsync, os.replace, fsync of the folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flashrt import __version__
from flashrt.io.atomic import atomic_write_bytes
from flashrt.io.files import open_regular
from flashrt.ops.native import Untrusted, check_folder, make_private_folder, read_own_file
from flashrt.paths import user_cache_dir

log = logging.getLogger(__name__)

FORMAT = "flashrt-onnx"
FORMAT_VERSION = 1
SUFFIX = ".onnxrt"
ENGINE_FORMAT = "flashrt-trt-engine"
ENGINE_SUFFIX = ".trtengine"
_TMP_PREFIX = ".tmp-"
MAX_ENTRY_BYTES = 2 << 30  # protobuf's limit: no ONNX model without external data is larger
MAX_ENGINE_BYTES = 16 << 30
_NAME_DIGEST_CHARS = 16


def default_root() -> Path:
    return user_cache_dir("onnx")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


class _Key:
    """Shared behaviour of the two key kinds (frozen dataclasses of str/int fields)."""

    suffix = SUFFIX
    format = FORMAT

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}  # type: ignore[attr-defined]

    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.fields()).encode()).hexdigest()

    def filename(self) -> str:
        return f"{self.model}-{self.digest()[:_NAME_DIGEST_CHARS]}{self.suffix}"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ExportKey(_Key):
    """Everything the exported model depends on (see module docstring)."""

    weights: str
    program: str
    shapes: str
    precision: str
    exporter: str
    runtime: str
    arch: str
    scheme: int
    model: str = "graph"


@dataclass(frozen=True)
class EngineKey(_Key):
    """Everything a TensorRT engine depends on (see module docstring): `onnx` is the sha256 of the ONNX
    model it is built from, `builder` the canonical JSON of the build options, `scales` the digest of
    the calibration scales it bakes in ("" for float precisions), `runtime` the TensorRT version,
    `arch` the compute capability ("sm90"), `device` the GPU's name."""

    weights: str
    program: str
    shapes: str
    precision: str
    exporter: str
    onnx: str
    builder: str
    scales: str
    runtime: str
    arch: str
    device: str
    scheme: int
    model: str = "trt"

    suffix = ENGINE_SUFFIX
    format = ENGINE_FORMAT


AnyKey = ExportKey | EngineKey
_KINDS: dict[str, tuple[str, type, int]] = {  # suffix -> (format, key class, size limit)
    SUFFIX: (FORMAT, ExportKey, MAX_ENTRY_BYTES),
    ENGINE_SUFFIX: (ENGINE_FORMAT, EngineKey, MAX_ENGINE_BYTES),
}


class _Unusable(Exception):
    """An entry that must not be used; the message is the reason."""


@dataclass(frozen=True)
class ExportEntry:
    """What `ls` shows: stored key fields (None when unreadable) and file facts; `kind` is "onnx" or
    "tensorrt" (from the suffix)."""

    path: Path
    size: int
    key: dict[str, Any] | None
    created: str = ""
    problem: str = ""
    kind: str = "onnx"


def _split(data: bytes, fmt: str = FORMAT) -> tuple[dict[str, Any], bytes]:
    if len(data) < 8:
        raise _Unusable(f"truncated file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise _Unusable(f"truncated file (header says {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError) as err:
        raise _Unusable(f"corrupt header JSON: {err}") from None
    if not isinstance(header, dict) or header.get("format") != fmt:
        raise _Unusable(f"not a {fmt} file")
    if header.get("format_version") != FORMAT_VERSION:
        raise _Unusable(f"format_version {header.get('format_version')!r}, this flashrt reads "
                        f"{FORMAT_VERSION}")
    if not isinstance(header.get("key"), dict):
        raise _Unusable("corrupt key in header")
    return header, data[8 + n:]


def _check(header: Mapping[str, Any], payload: bytes) -> None:
    if header.get("key_digest") != hashlib.sha256(_canonical(header["key"]).encode()).hexdigest():
        raise _Unusable("key fields do not match their recorded digest (header edited)")
    if header.get("payload_bytes") != len(payload):
        raise _Unusable(f"truncated or padded model ({len(payload)} bytes, header says "
                        f"{header.get('payload_bytes')})")
    if header.get("payload_digest") != hashlib.sha256(payload).hexdigest():
        raise _Unusable("model bytes do not match their recorded digest (edited or corrupted)")


def _mismatch(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> str:
    diffs = sorted(n for n in set(stored) | set(expected) if stored.get(n) != expected.get(n))
    return f"key mismatch ({', '.join(diffs)} differ)"


def _read(path: Path) -> tuple[dict[str, Any], bytes]:
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    fmt, _, limit = _KINDS.get(path.suffix, _KINDS[SUFFIX])
    try:
        data = read_own_file(path, "export cache entry", limit + (1 << 20))
    except Untrusted as err:
        raise _Unusable(str(err)) from None
    header, payload = _split(data, fmt)
    _check(header, payload)
    return header, payload


class ExportCache:
    """A folder of exported models and built engines, each entry checked against its key on load."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.last_miss_reason = ""

    def path_for(self, key: AnyKey) -> Path:
        return self.root / key.filename()

    def load(self, key: AnyKey) -> bytes | None:
        """The model (engine) bytes of `key`, or None (reason in `last_miss_reason`)."""
        path = self.path_for(key)
        try:
            _check_root(self.root)
            header, payload = _read(path)
            if header["key"] != key.fields():
                raise _Unusable(_mismatch(header["key"], key.fields()))
        except FileNotFoundError:
            self.last_miss_reason = "no entry"
            return None
        except _Unusable as err:
            log.warning("export cache entry %s not used: %s", path, err)
            self.last_miss_reason = str(err)
            return None
        self.last_miss_reason = ""
        return payload

    def store(self, key: AnyKey, payload: bytes) -> Path:
        header = {"format": key.format, "format_version": FORMAT_VERSION, "key": key.fields(),
                  "key_digest": key.digest(), "payload_digest": hashlib.sha256(payload).hexdigest(),
                  "payload_bytes": len(payload), "created": datetime.now(UTC).isoformat(timespec="seconds"),
                  "flashrt_version": __version__}
        head = _canonical(header).encode()
        path = self.path_for(key)
        make_private_folder(self.root)
        try:
            check_folder(self.root)
        except Untrusted as err:
            raise PermissionError(f"not storing in an unsafe cache folder: {err}") from None
        atomic_write_bytes(path, len(head).to_bytes(8, "little") + head + payload, tmp_prefix=_TMP_PREFIX)
        _fsync_dir(path.parent)
        return path

    def get_or_export(self, key: AnyKey, export: Callable[[], bytes]) -> tuple[bytes, bool]:
        """(bytes, hit): the cached entry of `key`, or `export()`'s (an export or an engine build), which
        is then stored."""
        payload = self.load(key)
        if payload is not None:
            return payload, True
        log.info("building (%s): %s", self.last_miss_reason, self.path_for(key).name)
        payload = export()
        try:
            self.store(key, payload)
        except OSError as err:  # a read-only or full cache folder must not stop the model from running
            log.warning("could not store export entry in %s: %s", self.root, err)
        return payload, False

    def files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for suffix in _KINDS for p in self.root.glob(f"*{suffix}"))

    def entries(self) -> list[ExportEntry]:
        """Header facts of every entry (the model bytes are checked too: entries are small); in a folder
        that fails the trust rules every entry's problem is that."""
        try:
            _check_root(self.root)
        except (_Unusable, FileNotFoundError) as err:
            return [ExportEntry(p, 0, None, problem=str(err)) for p in self.files()]
        return [_entry(p) for p in self.files()]


def _entry(path: Path) -> ExportEntry:
    size = 0
    key_type = _KINDS.get(path.suffix, _KINDS[SUFFIX])[1]
    kind = "tensorrt" if key_type is EngineKey else "onnx"
    try:
        with open_regular(path, "export cache entry", _Unusable) as f:
            size = os.fstat(f.fileno()).st_size
        header, _ = _read(path)
    except (_Unusable, OSError) as err:
        return ExportEntry(path, size, None, problem=str(err), kind=kind)
    fields = set(key_type.__dataclass_fields__)
    expected = key_type(**header["key"]).filename() if set(header["key"]) == fields else None
    problem = "" if expected == path.name else f"stored under {path.name} but its key belongs to {expected}"
    return ExportEntry(path, size, header["key"], header.get("created", ""), problem, kind)


def _check_root(root: Path) -> None:
    """FileNotFoundError when the folder is absent (no entry), _Unusable when it fails the trust rules."""
    if not os.path.lexists(root):
        raise FileNotFoundError(root)
    try:
        check_folder(root)
    except Untrusted as err:
        raise _Unusable(f"untrusted cache folder: {err}") from None


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

