"""Declared static buffers: every tensor a captured graph reads or writes, named and allocated once.

Ownership and lifetime: a `Buffers` object belongs to one frontend. Its tensors are allocated in the
constructor and never reallocated; a captured graph holds raw pointers to them, so replacing a tensor
(rather than writing into it) would silently detach the graph. `populate()` is the only writer of
input buffers on the hot path; it validates *every* given input before it copies *any*, so a bad call
leaves the previous contents intact and the next good call starts from a clean state.

Roles:
    input    written by `populate()` from user data before each replay
    output   written by the graph, read (copied out) after replay
    scratch  graph-internal intermediates that must live at a fixed address
    state    persists across replays (e.g. a K/V cache filled by an earlier stage)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from flashrt.errors import InputError

Role = Literal["input", "output", "scratch", "state"]
ROLES: tuple[str, ...] = ("input", "output", "scratch", "state")


@dataclass(frozen=True)
class BufferSpec:
    """One static buffer: its name, fixed shape and dtype, role, and what a valid input looks like."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role = "input"
    low: float | None = None
    high: float | None = None
    finite: bool = True
    accepts: tuple[torch.dtype, ...] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.role not in ROLES:
            raise ValueError(f"buffer {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"buffer {self.name!r}: negative dimension in {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise InputError(f"{name}: object arrays are not accepted; pass a numeric array")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (int, float, bool, list, tuple)):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name}: cannot be read as a tensor ({exc})") from None
    raise InputError(f"{name}: expected a tensor or numpy array, got {type(value).__name__}")


def check_value(spec: BufferSpec, value: Any) -> torch.Tensor:
    """Validate one input against its spec; return it as a tensor. Raises InputError naming the field."""
    t = _as_tensor(spec.name, value)
    if tuple(t.shape) != spec.shape:
        raise InputError(f"{spec.name}: expected shape {spec.shape}, got {tuple(t.shape)}")
    if t.dtype != spec.dtype and t.dtype not in spec.accepts:
        allowed = ", ".join(str(d) for d in (spec.dtype, *spec.accepts))
        raise InputError(f"{spec.name}: expected dtype {allowed}, got {t.dtype}")
    if t.is_floating_point() and spec.finite and not bool(torch.isfinite(t).all()):
        raise InputError(f"{spec.name}: contains NaN or inf")
    _check_range(spec, t)
    return t


def _check_range(spec: BufferSpec, t: torch.Tensor) -> None:
    if t.numel() == 0 or (spec.low is None and spec.high is None):
        return
    lo, hi = t.min().item(), t.max().item()
    if spec.low is not None and lo < spec.low:
        raise InputError(f"{spec.name}: value {lo} below the allowed minimum {spec.low}")
    if spec.high is not None and hi > spec.high:
        raise InputError(f"{spec.name}: value {hi} above the allowed maximum {spec.high}")


@dataclass
class Buffers:
    """All static buffers of one frontend, allocated once on one device."""

    specs: tuple[BufferSpec, ...]
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(init=False, repr=False)

    def __init__(self, specs: Iterable[BufferSpec], device: str | torch.device = "cpu") -> None:
        self.specs = tuple(specs)
        self.device = torch.device(device)
        names = [s.name for s in self.specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"buffer names declared twice: {dupes}")
        self._by_name = {s.name: s for s in self.specs}
        self.tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=self.device) for s in self.specs}

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no buffer named {name!r}; declared: {sorted(self.tensors)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> BufferSpec:
        return self._by_name[name]

    def names(self, role: Role | None = None) -> list[str]:
        return [s.name for s in self.specs if role is None or s.role == role]

    def nbytes(self, role: Role | None = None) -> int:
        return sum(s.nbytes for s in self.specs if role is None or s.role == role)

    def summary(self) -> str:
        """A table of every buffer: name, role, shape, dtype, size; and the totals per role."""
        lines = [f"{'buffer':32} {'role':7} {'shape':24} {'dtype':16} {'bytes':>12}"]
        for s in self.specs:
            lines.append(f"{s.name:32} {s.role:7} {str(s.shape):24} {str(s.dtype):16} {s.nbytes:12,d}")
        totals = ", ".join(f"{r} {self.nbytes(r):,d}" for r in ROLES if self.names(r))
        lines.append(f"total {self.nbytes():,d} bytes on {self.device} ({totals})")
        return "\n".join(lines)

    def validate(self, inputs: Mapping[str, Any], partial: bool = False) -> dict[str, torch.Tensor]:
        """Check every input (names, shape, dtype, finiteness, range) without touching any buffer."""
        unknown = sorted(set(inputs) - set(self.names("input")))
        if unknown:
            raise InputError(f"unknown input(s) {unknown}; inputs are {self.names('input')}")
        missing = [n for n in self.names("input") if n not in inputs]
        if missing and not partial:
            raise InputError(f"missing input(s) {missing}")
        return {name: check_value(self._by_name[name], value) for name, value in inputs.items()}

    def populate(self, inputs: Mapping[str, Any], partial: bool = False) -> None:
        """Validate all inputs first, then copy them into their static buffers (the only hot-path writer)."""
        self.write(self.validate(inputs, partial=partial))

    def write(self, checked: Mapping[str, torch.Tensor]) -> None:
        """The copying half of `populate`, for values already value-checked (by `validate`, or derived
        from inputs a frontend validated itself). Names, roles and shapes are still checked — all of them
        before anything is copied; finiteness and ranges are not scanned a second time."""
        for name, value in checked.items():
            spec = self._by_name.get(name)
            if spec is None or spec.role != "input":
                raise InputError(f"{name}: not an input buffer; inputs are {self.names('input')}")
            if tuple(value.shape) != spec.shape:
                raise InputError(f"{spec.name}: expected shape {spec.shape}, got {tuple(value.shape)}")
        for name, value in checked.items():
            self.tensors[name].copy_(value, non_blocking=True)

    def read(self, name: str) -> torch.Tensor:
        """A copy of a buffer's contents (safe to keep after the next replay overwrites the buffer)."""
        return self[name].clone()

    def zero_(self, role: Role | None = None) -> None:
        for name in self.names(role):
            self.tensors[name].zero_()
