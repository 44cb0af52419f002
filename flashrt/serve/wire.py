"""The openpi wire format: msgpack with numpy arrays, as `openpi_client.msgpack_numpy` writes it.

An array travels as a map ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str,
b"shape": [..]}`` and a numpy scalar as ``{b"__npgeneric__": True, b"data": value, b"dtype": ..}``.

Decoding treats every message as untrusted: only bool, integer and float dtypes of at most 8 bytes are
rebuilt (an object or void dtype would have numpy read raw bytes as pointers; float128 is a type torch
cannot hold), the byte count must equal shape x itemsize, nesting and sizes are capped, and anything else
is a `WireError` (the server answers it and keeps the connection). Decoded arrays are copies (writable,
owning their memory).

Every `WireError` carries a machine-readable ``code``: "invalid_message" (not msgpack, a text frame, a
malformed array), "unsupported_dtype" (a dtype, or values, the policy cannot take without changing
them), "invalid_observation" (the server's own keys, e.g. ``noise`` that is not an array).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

__all__ = ["WireError", "packb", "unpackb", "MAX_DIMS", "MAX_ITEMSIZE", "coerce"]

ALLOWED_KINDS = frozenset("biuf")
MAX_ITEMSIZE = 8  # float64 / int64: the widest dtypes both numpy and torch hold
MAX_DIMS = 8


class WireError(ValueError):
    """A message that is not valid openpi msgpack (or asks for a forbidden dtype / shape); ``code`` says
    which kind (module docstring)."""

    def __init__(self, message: str, code: str = "invalid_message") -> None:
        super().__init__(message)
        self.code = code


def _sendable(dtype: np.dtype) -> bool:
    return dtype.kind in ALLOWED_KINDS and dtype.itemsize <= MAX_ITEMSIZE


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if not _sendable(obj.dtype):
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str,
                b"shape": list(arr.shape)}
    if isinstance(obj, np.generic):
        if not _sendable(obj.dtype):
            raise TypeError(f"cannot send a scalar of dtype {obj.dtype}")
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
    if not _sendable(dtype):
        raise WireError(f"array dtype {dtype} is not accepted (only bool, int, uint and float of at most "
                        f"{8 * MAX_ITEMSIZE} bits)", "unsupported_dtype")
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


FLOAT_EXACT = 2**24  # integers up to this magnitude are exact in float32


def coerce(obj: Any, path: str = "") -> Any:
    """An observation whose arrays are in dtypes a policy takes, converted only where no value changes:
    image arrays (a key path holding "image") to uint8 when integer/bool data lies in 0..255, float16
    to float32; other arrays (state, noise, ...) to float32 from float16, or from integers that float32
    holds exactly. Anything else is a `WireError` naming the key (the server answers it and keeps the
    connection): the policy never sees a dtype it would fail on."""
    if isinstance(obj, dict):
        return {k: coerce(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [coerce(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, np.ndarray):
        return obj
    if obj.dtype == np.float16:
        return obj.astype(np.float32)
    if obj.dtype.kind not in "biu":
        return obj
    if "image" in path.lower():
        return _as_uint8(obj, path)
    return _as_float32(obj, path)


def _as_uint8(arr: np.ndarray, path: str) -> np.ndarray:
    if arr.dtype == np.uint8:
        return arr
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 255):
        raise WireError(f"{path}: a {arr.dtype} image with values in [{int(arr.min())}, {int(arr.max())}] "
                        f"does not fit uint8; send uint8 (0..255) or float (0..1)", "unsupported_dtype")
    return arr.astype(np.uint8)


def _as_float32(arr: np.ndarray, path: str) -> np.ndarray:
    if arr.dtype.kind == "b":
        raise WireError(f"{path}: a bool array where numbers are expected; send float32", "unsupported_dtype")
    if arr.size and int(np.abs(arr.astype(np.int64) if arr.dtype != np.uint64 else arr).max()) > FLOAT_EXACT:
        raise WireError(f"{path}: {arr.dtype} values beyond {FLOAT_EXACT} are not exact in float32; "
                        f"send float32", "unsupported_dtype")
    return arr.astype(np.float32)
