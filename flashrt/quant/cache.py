"""Calibration cache: one safetensors file of scales per CacheKey, verified on every load.

Ownership and validity (house style #9):
- Owner: the `CalibrationCache` folder (default `platformdirs.user_cache_dir("flashrt")/calibration`,
  or the `root` argument; no environment variable is read). Entries are shared by every process of
  the user; any of them may add or replace entries at any time.
- Valid for exactly one `CacheKey`: the digest of the checkpoint's tensor data, the model config, the
  static shapes, the calibration recipe (method, percentile, samples, data digest), the precision spec,
  the device arch and the flashrt scheme version. Change any of them and the entry is not found.
- Reuse across keys breaks quantized outputs silently (wrong scales saturate or waste range), so the key
  fields are stored inside the file and compared field by field on load, and the scales carry a digest
  of their bytes. Anything unexpected -- no file, corrupt header JSON, truncated file, edited scale
  values, an entry renamed or copied under another key -- is a miss: logged (warning, except a plain
  absence) and returned as a reason, never used.

File layout: `<model>-<key digest[:16]>.safetensors` holding the scale tensors, with metadata
    format="flashrt-calibration", format_version, key (canonical JSON of the key fields), key_digest,
    scales_digest (io.digest.tensor_digest of the scales), created (UTC ISO), flashrt_version.
Writes are atomic: temp file in the same folder, fsync, os.replace, fsync of the folder. Concurrent
writers of the same key race benignly (last replace wins, each entry complete); readers see a whole
old entry, a whole new one, or none.

Use from a frontend (the whole key, then calibrate only on a miss; device_arch from runtime.device):

    cache = CalibrationCache()                      # or CalibrationCache(root) from the profile
    key = CacheKey.create(data_digest=cache.data_digest(checkpoint_path), config=cfg,
                          shapes={"views": 2, "chunk": 10, "steps": 10}, precision=spec,
                          recipe=recipe.key_fields(samples_digest(samples)),
                          arch=device_arch(device), model="pi05")
    scales = cache.get_or_calibrate(key, lambda: calibrate(model, samples, recipe, spec.activations.dtype))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from flashrt import __version__
from flashrt.errors import CalibrationError
from flashrt.io.atomic import atomic_write_bytes
from flashrt.io.digest import file_digest, tensor_digest
from flashrt.io.files import open_regular, read_bytes_capped
from flashrt.paths import user_cache_dir

log = logging.getLogger(__name__)

SCHEME_VERSION = 1  # bump when what a stored scale means changes (qmax, rounding, layout)
FORMAT = "flashrt-calibration"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_TMP_SUFFIX = ".partial"  # flashrt.io.atomic's temp files: `<prefix>...partial`
REPORT_SUFFIX = ".report.json"  # flashrt.quant.flow's per-layer report beside an entry
MAX_ENTRY_BYTES = 256 << 20  # scales are a few KB; anything near this is not an entry
_NAME_DIGEST_CHARS = 16  # file names only; the full key is stored inside and compared on load
Scales = dict[str, torch.Tensor]


def default_root() -> Path:
    """The per-user calibration cache folder."""
    return user_cache_dir("calibration")


# ---------------------------------------------------------------------------------------------- the key


def _plain(obj: Any) -> Any:
    if callable(getattr(obj, "cache_fields", None)):  # e.g. PrecisionSpec: drops its display name
        return _plain(obj.cache_fields())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot put {type(obj).__name__} {obj!r} into a cache key; use plain data")


def canonical_json(obj: Any) -> str:
    """One JSON text per value: dataclasses as dicts, sorted keys, no whitespace, no NaN."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class CacheKey:
    """Everything that changes the scales. JSON-valued fields hold canonical JSON text (see `create`)."""

    data_digest: str
    config: str
    shapes: str
    recipe: str
    precision: str
    arch: str
    scheme: int = SCHEME_VERSION
    model: str = ""

    @classmethod
    def create(cls, *, data_digest: str, config: Any, shapes: Any, recipe: Any, precision: Any, arch: str,
               model: str = "", scheme: int = SCHEME_VERSION) -> CacheKey:
        """Build from plain data or dataclasses (model config, shapes dict, recipe fields, precision).

        Objects with a `cache_fields()` method (PrecisionSpec) contribute that; for a Recipe pass
        `recipe.key_fields(samples_digest(samples))`.
        """
        return cls(data_digest=data_digest, config=canonical_json(config), shapes=canonical_json(shapes),
                   recipe=canonical_json(recipe), precision=canonical_json(precision), arch=arch,
                   scheme=scheme, model=model)

    def fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return _fields_digest(self.fields())

    def filename(self) -> str:
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model).strip("._")
        short = self.digest()[:_NAME_DIGEST_CHARS]
        return f"{model}-{short}{SUFFIX}" if model else f"{short}{SUFFIX}"


def _fields_digest(fields: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(fields).encode()).hexdigest()


def _key_mismatch(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> str:
    names = sorted(set(stored) | set(expected))
    diffs = [n for n in names if stored.get(n) != expected.get(n)]
    detail = "; ".join(f"{n}: stored {_short(stored.get(n))}, expected {_short(expected.get(n))}"
                       for n in diffs)
    return f"key mismatch ({', '.join(diffs)} differ): {detail}"


def _short(value: Any, limit: int = 48) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------ entry files


class _Unusable(Exception):
    """An entry that must not be used; the message is the reason."""


@dataclass(frozen=True)
class EntryInfo:
    """What `ls` shows: the stored key fields (None when the header is unreadable) and file facts."""

    path: Path
    size: int
    key: dict[str, Any] | None
    created: str = ""
    n_scales: int = 0
    problem: str = ""


@dataclass(frozen=True)
class Lookup:
    """Result of one load: scales on a hit, else the reason for the miss."""

    path: Path
    scales: Scales | None
    reason: str = ""

    @property
    def hit(self) -> bool:
        return self.scales is not None


def _parse_header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise _Unusable(f"truncated file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise _Unusable(f"truncated file (header says {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError) as err:
        raise _Unusable(f"corrupt header JSON: {err}") from None
    if not isinstance(header, dict):
        raise _Unusable("corrupt header JSON: not an object")
    return header


def _parse_meta(header: Mapping[str, Any]) -> dict[str, Any]:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Unusable(f"not a {FORMAT} file (metadata format missing or different)")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise _Unusable(f"format_version {meta.get('format_version')!r}, this flashrt reads {FORMAT_VERSION}")
    try:
        key = json.loads(meta["key"])
    except (KeyError, ValueError) as err:
        raise _Unusable(f"corrupt key JSON in metadata: {err!r}") from None
    if not isinstance(key, dict):
        raise _Unusable("corrupt key JSON in metadata: not an object")
    return {**meta, "key": key}


def _read_entry(path: Path) -> tuple[Scales, dict[str, Any]]:
    """Parse and self-check one entry (format, key digest, scales digest, values); _Unusable otherwise."""
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    data = read_bytes_capped(path, "calibration entry", _Unusable, limit=MAX_ENTRY_BYTES)
    meta = _parse_meta(_parse_header(data))
    try:
        scales = safetensors.torch.load(data)
    except Exception as err:  # safetensors raises its own error types for truncation and bad offsets
        raise _Unusable(f"unreadable tensors: {err}") from None
    _check_self_consistent(scales, meta)
    return scales, meta


def _check_self_consistent(scales: Scales, meta: Mapping[str, Any]) -> None:
    if meta.get("key_digest") != _fields_digest(meta["key"]):
        raise _Unusable("key fields do not match their recorded digest (metadata edited)")
    if meta.get("scales_digest") != tensor_digest(scales):
        raise _Unusable("scale tensors do not match their recorded digest (values edited or corrupted)")
    bad = sorted(n for n, t in scales.items() if not _valid_scale(t))
    if bad:
        raise _Unusable(f"non-finite, non-positive or non-float scales: {bad}")


def _valid_scale(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool(torch.isfinite(t).all()) and bool((t > 0).all())


def _check_scales(scales: Mapping[str, torch.Tensor]) -> Scales:
    """CPU contiguous copies of the scales; CalibrationError for anything that must not be stored."""
    if not scales:
        raise CalibrationError("refusing to store an empty scale set")
    wrong = sorted(str(n) for n, t in scales.items()
                   if not isinstance(n, str) or not isinstance(t, torch.Tensor))
    if wrong:
        raise CalibrationError(f"scales must map str -> torch.Tensor; bad entries: {wrong}")
    bad = sorted(n for n, t in scales.items() if not _valid_scale(t))
    if bad:
        raise CalibrationError(f"refusing to store non-finite, non-positive or non-float scales: {bad}")
    return {n: t.detach().to("cpu").contiguous().clone() for n, t in scales.items()}


def _atomic_write(path: Path, payload: bytes) -> None:
    atomic_write_bytes(path, payload, tmp_prefix=_TMP_PREFIX)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem can fsync a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _header_info(path: Path) -> EntryInfo:
    size = 0
    try:
        with open_regular(path, "calibration entry", _Unusable) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = _parse_header(head + f.read(min(n, 100 << 20)))
        meta = _parse_meta(header)
    except (_Unusable, OSError) as err:
        return EntryInfo(path, size, None, problem=str(err))
    n_scales = sum(1 for k in header if k != "__metadata__")
    return EntryInfo(path, size, meta["key"], meta.get("created", ""), n_scales)


# --------------------------------------------------------------------------------------------- the cache


class CalibrationCache:
    """A folder of calibration entries. The constructor touches nothing; `store` creates the folder."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.last_miss_reason = ""

    def path_for(self, key: CacheKey) -> Path:
        return self.root / key.filename()

    def data_digest(self, path: str | os.PathLike) -> str:
        """Digest of a checkpoint file or folder, memoized in this cache's folder (hashed once per file)."""
        return file_digest(path, memo_dir=self.root)

    def lookup(self, key: CacheKey) -> Lookup:
        """Load and check the entry of `key` (thread-safe; `load` is the short form)."""
        path = self.path_for(key)
        try:
            scales, meta = _read_entry(path)
            if meta["key"] != key.fields():
                raise _Unusable(_key_mismatch(meta["key"], key.fields()))
        except FileNotFoundError:
            return Lookup(path, None, "no entry")
        except _Unusable as err:
            log.warning("calibration cache entry %s not used: %s", path, err)
            return Lookup(path, None, str(err))
        return Lookup(path, scales)

    def load(self, key: CacheKey) -> Scales | None:
        """Scales of `key`, or None on a miss (reason in `last_miss_reason`; not thread-safe, see lookup)."""
        result = self.lookup(key)
        self.last_miss_reason = result.reason
        return result.scales

    def store(self, key: CacheKey, scales: Mapping[str, torch.Tensor]) -> Path:
        """Write the entry of `key` atomically; returns its path."""
        tensors = _check_scales(scales)
        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "key": canonical_json(key.fields()),
                "key_digest": key.digest(), "scales_digest": tensor_digest(tensors),
                "created": datetime.now(UTC).isoformat(timespec="seconds"), "flashrt_version": __version__}
        path = self.path_for(key)
        _atomic_write(path, safetensors.torch.save(tensors, metadata=meta))
        return path

    def get_or_calibrate(self, key: CacheKey, calibrate: Callable[[], Mapping[str, torch.Tensor]]) -> Scales:
        """The cached scales of `key`, or `calibrate()`'s, which are then stored (and returned on CPU)."""
        scales = self.load(key)
        if scales is not None:
            return scales
        log.info("calibrating (%s): %s", self.last_miss_reason, self.path_for(key).name)
        fresh = _check_scales(calibrate())
        try:
            self.store(key, fresh)
        except OSError as err:  # a read-only or full cache folder must not stop the model from running
            log.warning("could not store calibration entry in %s: %s", self.root, err)
        return fresh

    def files(self) -> list[Path]:
        return sorted(self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else []

    def entries(self) -> list[EntryInfo]:
        """Header facts of every entry (cheap: tensors are not read)."""
        return [_header_info(p) for p in self.files()]

    def verify(self) -> list[tuple[Path, bool, str]]:
        """(path, ok, reason) for every entry: readable, self-consistent, stored under its own key digest."""
        return [(p, *_verify_file(p)) for p in self.files()]

    def remove(self, name: str | None = None, all: bool = False) -> list[Path]:
        """Delete one entry (file name, stem or unique prefix of it) or, with all=True, every entry and
        leftover temp file. Only files that carry this cache's metadata are entries: any other
        ``*.safetensors`` in the folder (a checkpoint's ``model.safetensors``) is never touched.
        Returns what was removed; ValueError on an ambiguous name."""
        targets = self._all_files() if all else self._match(name)
        for p in targets:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            with contextlib.suppress(FileNotFoundError):  # the quality-gate report written beside it
                p.with_name(p.stem + REPORT_SUFFIX).unlink()
        return targets

    def _entry_files(self) -> list[Path]:
        return [p for p in self.files() if _is_entry(p)]

    def _all_files(self) -> list[Path]:
        temps = sorted(self.root.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}")) if self.root.is_dir() else []
        return self._entry_files() + temps

    def _match(self, name: str | None) -> list[Path]:
        if not name:
            raise ValueError("name an entry to remove, or pass all=True")
        entries = self._entry_files()
        exact = [p for p in entries if name in (p.name, p.stem)]
        matches = exact or [p for p in entries if p.stem.startswith(name)]
        if len(matches) > 1:
            raise ValueError(f"{name!r} matches {len(matches)} entries: {[p.name for p in matches]}")
        return matches


def _is_entry(path: Path) -> bool:
    """Whether ``path`` carries this cache's metadata (``format``), whatever else may be wrong with it."""
    try:
        with open_regular(path, "calibration entry", _Unusable) as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            if n > MAX_ENTRY_BYTES:
                return False
            meta = _parse_header(head + f.read(n)).get("__metadata__")
    except (_Unusable, OSError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _verify_file(path: Path) -> tuple[bool, str]:
    try:
        _, meta = _read_entry(path)
    except FileNotFoundError:
        return False, "removed while verifying"
    except _Unusable as err:
        return False, str(err)
    expected = CacheKey(**meta["key"]).filename() if set(meta["key"]) == _KEY_FIELDS else None
    if expected != path.name:
        return False, f"stored under {path.name} but its key belongs to {expected} (renamed or copied)"
    return True, "ok"


_KEY_FIELDS = {f.name for f in dataclasses.fields(CacheKey)}
