"""The openpi wire format: msgpack with numpy arrays, as `openpi_client.msgpack_numpy` writes it.

An array travels as a map ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str,
b"shape": [..]}`` and a numpy scalar as ``{b"__npgeneric__": True, b"data": value, b"dtype": ..}``.

Decoding treats every message as untrusted: only bool, integer and float dtypes are rebuilt (an object
or void dtype would have numpy read raw bytes as pointers), the byte count must equal shape x itemsize,
nesting and sizes are capped, and anything else is a `WireError` (the server answers it and keeps the
connection). Decoded arrays are copies (writable, owning their memory).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

__all__ = ["WireError", "packb", "unpackb", "MAX_DIMS"]

ALLOWED_KINDS = frozenset("biuf")
MAX_DIMS = 8


class WireError(ValueError):
    """A message that is not valid openpi msgpack (or asks for a forbidden dtype / shape)."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str,
                b"shape": list(arr.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """Encode a nest of dicts / lists / scalars / numpy arrays."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def _dtype(spec: Any) -> np.dtype:
    if not isinstance(spec, str | bytes):
        raise WireError(f"array dtype must be a string, got {type(spec).__name__}")
    try:
        dtype = np.dtype(spec.decode() if isinstance(spec, bytes) else spec)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"unknown array dtype {spec!r}") from exc
    if dtype.kind not in ALLOWED_KINDS or dtype.itemsize > 16:
        raise WireError(f"array dtype {dtype} is not accepted (only bool, int, uint, float)")
    return dtype


def _shape(spec: Any) -> tuple[int, ...]:
    if not isinstance(spec, list | tuple) or len(spec) > MAX_DIMS:
        raise WireError(f"array shape must be a list of at most {MAX_DIMS} ints, got {spec!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in spec):
        raise WireError(f"array shape must hold non-negative ints, got {spec!r}")
    return tuple(spec)


def _array(obj: dict) -> np.ndarray:
    data = obj.get(b"data")
    if not isinstance(data, bytes):
        raise WireError("array data must be bytes")
    dtype, shape = _dtype(obj.get(b"dtype")), _shape(obj.get(b"shape"))
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(data):
        raise WireError(f"array of shape {shape} and dtype {dtype} needs "
                        f"{int(np.prod(shape, dtype=np.int64)) * dtype.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _generic(obj: dict) -> np.generic:
    dtype, value = _dtype(obj.get(b"dtype")), obj.get(b"data")
    if isinstance(value, bool | int | float):
        try:
            return dtype.type(value)
        except (OverflowError, ValueError) as exc:
            raise WireError(f"numpy scalar {value!r} does not fit {dtype}") from exc
    raise WireError(f"numpy scalar data must be a number, got {type(value).__name__}")


def _hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _generic(obj)
    return obj


def _keys(obj: Any) -> Any:
    """bytes map keys -> str (openpi's client packs str keys; keep both spellings working)."""
    if isinstance(obj, dict):
        return {(k.decode() if isinstance(k, bytes) else k): _keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_keys(v) for v in obj]
    return obj


def unpackb(data: bytes, max_bytes: int) -> Any:
    """Decode one untrusted message of at most `max_bytes` bytes; WireError when it is not valid."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("expected a binary msgpack message, got text")
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(bytes(data), object_hook=_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise WireError(f"not a msgpack message: {exc}") from exc
    return _keys(obj)
