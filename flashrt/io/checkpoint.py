"""Open weight files as one read-only, lazy `Checkpoint` mapping; write safetensors atomically.

Formats (dispatched by suffix through `_OPENERS`, never an if-ladder):

- ``*.safetensors``: the header is parsed and checked against the file size when the file is opened,
  so a truncated, padded or corrupt file fails at once with a CheckpointError naming the file and the
  expected vs actual byte counts. Tensors are read lazily, one key at a time, from the memory map of
  ``safetensors.safe_open``.
- ``*.safetensors.index.json`` (sharded): ``weight_map`` names the shard of every key; every shard is
  opened (and checked) up front, a missing shard or a key absent from its shard is a CheckpointError.
- ``*.bin / *.pt / *.pth / *.ckpt`` (PyTorch): ``torch.load(weights_only=True, map_location="cpu")``,
  memory-mapped when the file is in the zip format. Anything that needs arbitrary unpickling is
  refused. ``subkey="generator"`` picks a nested state dict; without a subkey a file whose top level
  holds exactly one dict of tensors (and no tensors) uses that dict, and ``Checkpoint.subkey`` says so.
- any other file name: sniffed from its first bytes (zip or pickle → PyTorch, a JSON header → safetensors).
- a directory: ``model.safetensors``, else one ``*.safetensors.index.json``, else one ``*.safetensors``,
  else ``pytorch_model.bin``, else one PyTorch file; anything else is a CheckpointError listing what
  was found.

Ownership: a Checkpoint holds open file handles until `close()` (or the end of a ``with`` block).
Tensors it returned stay valid after closing (they are copies or private maps).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import CheckpointError
from flashrt.io.atomic import atomic_write_bytes
from flashrt.io.files import check_regular, open_regular, read_json, resolve_inside

log = logging.getLogger(__name__)

__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint", "save_safetensors", "TORCH_SUFFIXES"]

TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    """What is known about one stored tensor without reading its data.

    ``data_offsets`` are absolute byte offsets ``[begin, end)`` in ``file`` (safetensors only).
    """

    shape: torch.Size
    dtype: torch.dtype
    file: Path | None
    data_offsets: tuple[int, int] | None = None


class Checkpoint(Mapping[str, torch.Tensor]):
    """A read-only ``Mapping[str, Tensor]`` over one or more weight files; tensors load on access.

    ``shape(key)`` / ``dtype(key)`` / ``info(key)`` answer from the header without reading data.
    ``metadata`` is the safetensors ``__metadata__`` (or the shard index's ``metadata``) dict.

    Returned tensors: from safetensors, a fresh CPU tensor per access (read again on the next access);
    from PyTorch files and `from_tensors`, the same stored tensor every time, so never modify one in
    place. Either kind stays valid after `close()`; reading a new key from a closed safetensors
    checkpoint is a CheckpointError.
    """

    def __init__(
        self,
        name: str,
        infos: Mapping[str, TensorInfo],
        fetch: Callable[[str], torch.Tensor],
        *,
        metadata: Mapping[str, Any] | None = None,
        files: tuple[Path, ...] = (),
        subkey: str | None = None,
        closer: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._infos = dict(infos)
        self._fetch = fetch
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.files = files
        self.subkey = subkey
        self._closer = closer

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], name: str = "<memory>") -> Checkpoint:
        """An in-memory checkpoint (tests, converted weights, tiny presets)."""
        tensors = dict(tensors)
        infos = {k: TensorInfo(v.shape, v.dtype, None) for k, v in tensors.items()}
        return cls(name, infos, tensors.__getitem__)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._infos:
            raise KeyError(key)
        return self._fetch(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    def shape(self, key: str) -> torch.Size:
        return self._infos[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._infos[key].dtype

    def nbytes(self) -> int:
        return sum(i.shape.numel() * i.dtype.itemsize for i in self._infos.values())

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        sub = f", subkey={self.subkey!r}" if self.subkey else ""
        return f"Checkpoint({self.name!r}, {len(self)} tensors, {len(self.files)} file(s){sub})"


def open_checkpoint(path: str | os.PathLike[str], subkey: str | None = None) -> Checkpoint:
    """Open a weight file, a shard index or a directory holding one (see module docstring)."""
    if not str(path):
        raise CheckpointError("checkpoint path is empty; pass the weight file or its folder")
    path = Path(path)
    try:
        found, is_dir = path.exists(), path.is_dir()
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the filesystem
        raise CheckpointError(f"checkpoint path {str(path)[:200]!r} is unusable: {exc}") from None
    if not found:
        raise CheckpointError(f"checkpoint not found: {path}")
    if is_dir:
        path = _pick_in_directory(path)
    check_regular(path, "checkpoint file")
    opener = _opener_for(path)
    if subkey is not None and opener is not _open_torch:
        raise CheckpointError(f"{path}: subkey={subkey!r} only applies to PyTorch files {TORCH_SUFFIXES}")
    return opener(path, subkey) if opener is _open_torch else opener(path)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    from safetensors.torch import save

    path = Path(path)
    payload = save(_unshared(tensors), metadata=dict(metadata) if metadata else None)
    atomic_write_bytes(path, payload, tmp_prefix=f".{path.name}.")
    return path


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies where needed; tensors sharing storage are cloned (safetensors refuses them)."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    return out


# ---------------------------------------------------------------------------------------- dispatch

def _opener_for(path: Path) -> Callable[..., Checkpoint]:
    name = path.name.lower()
    for suffix, opener in _OPENERS:
        if name.endswith(suffix):
            return opener
    sniffed = _sniff(path)
    if sniffed is None:
        supported = ", ".join(s for s, _ in _OPENERS)
        raise CheckpointError(f"{path}: unknown checkpoint format (supported: {supported}, or a directory)")
    return sniffed


def _sniff(path: Path) -> Callable[..., Checkpoint] | None:
    """Opener for a file without a known suffix (e.g. HiFi-GAN's ``g_02500000``), from its first bytes."""
    with open_regular(path, "checkpoint file") as f:
        head = f.read(9)
    if zipfile.is_zipfile(path) or head[:1] == b"\x80":  # torch zip format, or a raw pickle
        return _open_torch
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < path.stat().st_size:
        return _open_safetensors
    return None


def _pick_in_directory(folder: Path) -> Path:
    """The one weight file of a checkpoint folder, by the preference order in the module docstring."""
    for pattern, allow_many in _DIR_PREFERENCE:
        found = sorted(folder.glob(pattern))
        if len(found) == 1:
            return found[0]
        if len(found) > 1 and not allow_many:
            names = ", ".join(p.name for p in found)
            raise CheckpointError(f"{folder}: ambiguous checkpoint, several {pattern} files: {names}; "
                                  "pass the file you mean")
    listing = ", ".join(sorted(p.name for p in folder.iterdir())[:30]) or "(empty)"
    looked = ", ".join(pattern for pattern, _ in _DIR_PREFERENCE)
    raise CheckpointError(f"{folder}: no checkpoint file found (looked for {looked}); "
                          f"the folder holds: {listing}")


_DIR_PREFERENCE: tuple[tuple[str, bool], ...] = (
    ("model.safetensors", False),
    ("*.safetensors.index.json", False),
    ("*.safetensors", False),
    ("pytorch_model.bin", False),
    *((f"*{s}", False) for s in TORCH_SUFFIXES),
)


# ----------------------------------------------------------------------------------- safetensors

def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header against the file size; no tensor data is read."""
    with open_regular(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, the header length "
                                  "alone needs 8)")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER_BYTES or n > size - 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header (declares {n} header "
                                  f"bytes, file has {size} bytes)")
        raw = f.read(n)
    header = _parse_header_json(path, raw)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    infos, end = _header_infos(path, header, base=8 + n)
    if end != size:
        what = "truncated" if size < end else "has trailing bytes"
        raise CheckpointError(f"{path}: safetensors file {what}: header expects {end} bytes, "
                              f"file has {size} bytes")
    return infos, dict(metadata)


def _parse_header_json(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (JSON is not an object)")
    return header


def _header_infos(path: Path, header: dict[str, Any], base: int) -> tuple[dict[str, TensorInfo], int]:
    """TensorInfo per key, plus the byte size the file must have; offsets must tile the data exactly."""
    infos: dict[str, TensorInfo] = {}
    spans = []
    for key, entry in header.items():
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = torch.Size(_header_ints(entry["shape"], "shape"))
            begin, end = _header_ints(entry["data_offsets"], "data_offsets", length=2)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header entry {key!r}: {entry!r} "
                                  f"({type(exc).__name__}: {exc})") from None
        if end - begin != shape.numel() * dtype.itemsize:
            raise CheckpointError(f"{path}: corrupt safetensors header: {key!r} spans {end - begin} bytes, "
                                  f"shape {tuple(shape)} {dtype} needs {shape.numel() * dtype.itemsize}")
        infos[key] = TensorInfo(shape, dtype, path, (base + begin, base + end))
        spans.append((begin, end, key))
    return infos, base + _check_tiling(path, spans)


_MAX_HEADER_INT = 1 << 62  # no tensor dimension or byte offset comes near this


def _header_ints(values: Any, what: str, length: int | None = None) -> list[int]:
    """A list of non-negative Python ints (not bools, floats or strings), as safetensors requires."""
    if not isinstance(values, list) or (length is not None and len(values) != length):
        raise ValueError(f"{what} must be a list" + (f" of {length}" if length else ""))
    if not all(type(v) is int and 0 <= v < _MAX_HEADER_INT for v in values):
        raise ValueError(f"{what} entries must be non-negative integers below 2**62")
    return values


def _check_tiling(path: Path, spans: list[tuple[int, int, str]]) -> int:
    cursor = 0
    for begin, end, key in sorted(spans):
        if begin != cursor:
            raise CheckpointError(f"{path}: corrupt safetensors header: {key!r} starts at byte {begin}, "
                                  f"expected {cursor} (overlapping or gapped data)")
        cursor = end
    return cursor


class _SafetensorsFiles:
    """Lazily opened ``safe_open`` handles, one per file, closed together."""

    def __init__(self, key_to_file: Mapping[str, Path]) -> None:
        self._key_to_file = key_to_file
        self._handles: dict[Path, Any] = {}
        self._closed = False

    def fetch(self, key: str) -> torch.Tensor:
        file = self._key_to_file[key]
        if self._closed:
            raise CheckpointError(f"{file}: checkpoint is closed; cannot read {key!r}")
        try:
            handle = self._handles.get(file)
            if handle is None:
                from safetensors import safe_open

                handle = self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            return handle.get_tensor(key)
        except Exception as exc:  # safetensors raises its own Rust-side error types
            raise CheckpointError(f"{file}: cannot read tensor {key!r}: {exc}") from exc

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._closed = True


def _open_safetensors(path: Path) -> Checkpoint:
    infos, metadata = _read_header(path)
    files = _SafetensorsFiles(dict.fromkeys(infos, path))
    return Checkpoint(str(path), infos, files.fetch, metadata=metadata, files=(path,), closer=files.close)


def _open_index(path: Path) -> Checkpoint:
    if not path.name.lower().endswith(".index.json"):
        raise CheckpointError(f"{path}: a .json checkpoint must be a shard index (*.safetensors.index.json)")
    index = _read_index(path)
    weight_map: dict[str, str] = index["weight_map"]
    shards = {name: resolve_inside(path.parent, name, f"{path}: weight_map[{key!r}]")
              for name, key in _first_keys(weight_map).items()}
    missing = [str(p) for p in shards.values() if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} shard file(s) missing: {', '.join(missing)}")
    shard_infos = {name: _read_header(file)[0] for name, file in shards.items()}
    infos = _index_infos(path, weight_map, shard_infos)
    files = _SafetensorsFiles({k: shards[weight_map[k]] for k in infos})
    return Checkpoint(str(path), infos, files.fetch, metadata=index.get("metadata") or {},
                      files=tuple(shards.values()), closer=files.close)


def _first_keys(weight_map: Mapping[str, Any]) -> dict[Any, str]:
    """Shard name -> the first key naming it (what an error about that shard name points at)."""
    first: dict[Any, str] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"shard index: weight_map[{key!r}] must be a file name, got {name!r}")
        first.setdefault(name, key)
    return first


def _read_index(path: Path) -> dict[str, Any]:
    index = read_json(path, "shard index")
    if not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: shard index has no 'weight_map' object")
    metadata = index.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: shard index 'metadata' must be an object, got {metadata!r}")
    return index


def _index_infos(
    path: Path, weight_map: Mapping[str, str], shard_infos: Mapping[str, Mapping[str, TensorInfo]]
) -> dict[str, TensorInfo]:
    """Key → info in index order; index and shards must agree on which key lives where."""
    absent = [f"{k} (in {s})" for k, s in weight_map.items() if k not in shard_infos[s]]
    unlisted = [f"{k} (in {s})" for s, inf in shard_infos.items() for k in inf if weight_map.get(k) != s]
    if absent or unlisted:
        detail = _clip("listed but absent", absent) + _clip("present but not listed", unlisted)
        raise CheckpointError(f"{path}: shard index disagrees with the shards: {detail}")
    return {k: shard_infos[s][k] for k, s in weight_map.items()}


def _clip(label: str, items: list[str], limit: int = 10) -> str:
    if not items:
        return ""
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"[{label}: {len(items)}] " + ", ".join(items[:limit]) + more + "; "


# --------------------------------------------------------------------------------------- pytorch

def _open_torch(path: Path, subkey: str | None = None) -> Checkpoint:
    obj = _torch_load(path)
    tensors, used = _select_state_dict(path, obj, subkey)
    infos = {k: TensorInfo(v.shape, v.dtype, path) for k, v in tensors.items()}
    return Checkpoint(str(path), infos, tensors.__getitem__, files=(path,), subkey=used)


def _torch_load(path: Path) -> Any:
    check_regular(path, "PyTorch weight file")
    mmap = zipfile.is_zipfile(path)  # only the zip format can be memory-mapped
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: not a weights-only state dict; it needs arbitrary unpickling, "
                              f"which flashrt refuses. Re-save it as tensors only (safetensors preferred). "
                              f"Detail: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # the unpickler of untrusted bytes raises KeyError, IndexError, struct.error...
        raise CheckpointError(f"{path}: corrupt or truncated PyTorch file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _select_state_dict(
    path: Path, obj: Any, subkey: str | None
) -> tuple[dict[str, torch.Tensor], str | None]:
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    if subkey is None:
        subkey = _auto_subkey(obj)
    if subkey is not None:
        if subkey not in obj:
            raise CheckpointError(f"{path}: no subkey {subkey!r}; top-level keys: {_describe_top(obj)}")
        obj = obj[subkey]
    keys = [k for k in obj if not isinstance(k, str)]
    if keys:
        raise CheckpointError(f"{path}: state dict keys must be strings, got {keys[:5]!r}")
    bad = [f"{k} ({type(v).__name__})" for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        hint = "" if subkey else "; pass subkey= to pick a nested state dict"
        raise CheckpointError(f"{path}: entries are not all tensors: {', '.join(bad[:10])}{hint}")
    return dict(obj), subkey


def _auto_subkey(obj: Mapping[str, Any]) -> str | None:
    """The single nested dict of tensors when the top level holds no tensors (e.g. ``{"generator": sd}``)."""
    if any(isinstance(v, torch.Tensor) for v in obj.values()):
        return None
    nested = [k for k, v in obj.items()
              if isinstance(v, Mapping) and v and all(isinstance(t, torch.Tensor) for t in v.values())]
    if len(nested) == 1:
        log.info("using nested state dict %r (auto-detected)", nested[0])
        return nested[0]
    return None


def _describe_top(obj: Mapping[str, Any]) -> str:
    return ", ".join(f"{k!r} ({type(v).__name__})" for k, v in list(obj.items())[:20])


_OPENERS: tuple[tuple[str, Callable[..., Checkpoint]], ...] = (
    (".safetensors", _open_safetensors),
    (".json", _open_index),
    *((s, _open_torch) for s in TORCH_SUFFIXES),
)
