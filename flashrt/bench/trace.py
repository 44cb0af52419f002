"""Frozen traces: the exact inputs a benchmark runs, each hashed, so results name what they measured.

An input is any nesting of dicts, lists/tuples, tensors, numpy arrays, strings and numbers. Its digest
is a sha256 over a canonical encoding: for every array leaf the dtype name, the shape and the raw
bytes; for containers their keys (sorted) and order; for scalars and strings a typed repr. A numpy
array and a tensor with the same dtype, shape and bytes hash the same, so a trace saved (as tensors)
and loaded back keeps its digests. The trace digest is the sha256 of the per-input digests in order.

Traces are generated from a seed by the benchmark adapter (`make_inputs(seed)`) or recorded to a file
(`save`) and replayed later (`load`, read with `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import InputError
from flashrt.io.files import check_regular

_FORMAT = "flashrt.trace/1"


def _array_bytes(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    if isinstance(x, np.ndarray):
        return x.dtype.name, tuple(x.shape), np.ascontiguousarray(x).tobytes()
    t = x.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), raw


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor | np.ndarray):
        dtype, shape, raw = _array_bytes(x)
        h.update(f"A|{dtype}|{shape}|{len(raw)}|".encode())
        h.update(raw)
    elif isinstance(x, Mapping):
        h.update(f"D|{len(x)}|".encode())
        for key in sorted(x, key=str):
            h.update(f"K|{key!s}|".encode())
            _feed(h, x[key])
    elif isinstance(x, list | tuple):
        h.update(f"L|{len(x)}|".encode())
        for item in x:
            _feed(h, item)
    elif isinstance(x, str | bytes | int | float | bool | np.generic) or x is None:
        h.update(f"S|{type(x).__name__}|{x!r}|".encode())
    else:
        raise InputError("trace inputs must be tensors, arrays, containers or scalars; "
                         f"got {type(x).__name__}")


def hash_input(x: Any) -> str:
    """sha256 hex digest of one input (dtype, shape and bytes of every array leaf; see module doc)."""
    h = hashlib.sha256()
    _feed(h, x)
    return h.hexdigest()


@dataclass(frozen=True)
class FrozenTrace:
    """An ordered, hashed list of benchmark inputs."""

    inputs: tuple[Any, ...]
    digests: tuple[str, ...]
    seed: int | None = None
    source: str = "generated"

    @classmethod
    def from_inputs(cls, inputs: Sequence[Any], seed: int | None = None,
                    source: str = "generated") -> FrozenTrace:
        if not inputs:
            raise InputError("a trace needs at least one input")
        items = tuple(inputs)
        return cls(items, tuple(hash_input(x) for x in items), seed, source)

    @property
    def digest(self) -> str:
        """sha256 over the per-input digests, in order."""
        return hashlib.sha256("\n".join(self.digests).encode()).hexdigest()

    def __len__(self) -> int:
        return len(self.inputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.inputs)

    def __getitem__(self, i: int) -> Any:
        return self.inputs[i % len(self.inputs)]

    def verify(self) -> None:
        """Re-hash every input; raises InputError if one changed since the trace was frozen."""
        for i, (x, digest) in enumerate(zip(self.inputs, self.digests)):
            if hash_input(x) != digest:
                raise InputError(f"trace input {i} changed after the trace was frozen (digest mismatch)")

    def record(self) -> dict[str, Any]:
        """What results keep of the trace: seed, source, length, digest and each input's digest."""
        return {"seed": self.seed, "source": self.source, "length": len(self), "digest": self.digest,
                "inputs": list(self.digests)}

    def save(self, path: str | Path) -> Path:
        """Write the inputs (arrays as tensors) and digests to `path` (a torch file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": _FORMAT, "seed": self.seed, "digests": list(self.digests),
                    "inputs": [_to_tensors(x) for x in self.inputs]}, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> FrozenTrace:
        """Read a recorded trace; refuses a file whose inputs no longer match their stored digests."""
        data = _read_trace_file(Path(path))
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise InputError(f"{path}: not a flashrt trace file (format {_FORMAT})")
        inputs, digests = data.get("inputs"), data.get("digests")
        if not isinstance(inputs, list | tuple) or not isinstance(digests, list | tuple):
            raise InputError(f"{path}: trace file without an 'inputs' and a 'digests' list (file altered?)")
        trace = cls.from_inputs(inputs, data.get("seed"), source=f"recorded:{Path(path).name}")
        if list(trace.digests) != list(digests):
            raise InputError(f"{path}: inputs do not match their recorded digests (file altered?)")
        return trace


def _read_trace_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a regular file; anything unreadable is an InputError."""
    check_regular(path, "trace file", InputError)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # an untrusted parser: whatever it raises means "not a trace file"
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise InputError(f"{path}: not a readable trace file ({type(exc).__name__}: {first}); record "
                         "one with `flashrt bench --save-trace`") from None


def _to_tensors(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, Mapping):
        return {k: _to_tensors(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_to_tensors(v) for v in x)
    return x
