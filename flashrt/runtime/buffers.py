"""Declared static buffers: every tensor a captured graph reads or writes, named and allocated once.

Ownership and lifetime: a `Buffers` object belongs to one frontend. Its tensors are allocated in the
constructor and never reallocated; a captured graph holds raw pointers to them, so replacing a tensor
(rather than writing into it) would silently detach the graph. `populate()` (or `write()` of values a
frontend validated itself, or `host()` + `upload()`) is the only writer of input buffers on the hot
path; it validates *every* given input before it copies *any*, so a bad call leaves the previous
contents intact and the next good call starts from a clean state.

Host staging (`host`, `upload`, `download`): the hot path of a GPU frontend fills a host tensor of the
buffer's shape and dtype, then copies it in with one asynchronous copy. The staging tensor is made on
first use and reused by every later call (no per-call allocation); it is page-locked ("pinned") when
the buffers live on a CUDA device (only then: pinning needs a CUDA driver), so `upload` is a true
``non_blocking`` copy. On the CPU `host(name)` IS the buffer and `upload` does nothing. Reuse hazard:
an upload reads its staging tensor after `upload` returns, so `host(name)` first waits for that name's
previous upload (one CUDA event per staged name, made once, recorded after each upload): a caller can
never overwrite staging data still in flight, and never waits for another buffer's copy.
`download(name)` copies a buffer into its pinned host twin and waits for it; the returned tensor is
that twin (CPU: the buffer itself), valid until the next download or replay.

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
    _check_values(spec, t)
    return t


def _check_values(spec: BufferSpec, t: torch.Tensor) -> None:
    """Finiteness and range from ONE reduction (aminmax: NaN propagates into both, an inf shows as an
    end), so a check allocates two scalars however large the input."""
    finite = t.is_floating_point() and spec.finite
    if t.numel() == 0 or not (finite or spec.low is not None or spec.high is not None):
        return
    lo, hi = (x.item() for x in torch.aminmax(t))
    if finite and not (math.isfinite(lo) and math.isfinite(hi)):
        raise InputError(f"{spec.name}: contains NaN or inf")
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
        self._staging: dict[tuple[str, str], torch.Tensor] = {}  # (name, "in" | "out") -> host twin
        self._uploaded: dict[str, Any] = {}  # name -> CUDA event recorded after its last upload

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

    # ------------------------------------------------------------------------------ host staging
    @property
    def staged(self) -> bool:
        """Whether host staging is a separate (pinned) tensor: buffers on a CUDA device."""
        return self.device.type == "cuda"

    def _twin(self, name: str, way: str) -> torch.Tensor:
        twin = self._staging.get((name, way))
        if twin is None:
            spec = self.spec(name)
            twin = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=torch.cuda.is_available())
            self._staging[(name, way)] = twin
        return twin

    def host(self, name: str) -> torch.Tensor:
        """The host tensor to fill before `upload(name)` (module docstring: pinned twin on CUDA, the
        buffer itself on the CPU); waits for the previous upload first."""
        if not self.staged:
            return self[name]
        if name in self._uploaded:
            self._uploaded[name].synchronize()
        return self._twin(name, "in")

    def upload(self, *names: str) -> None:
        """Copy the host twins of `names` into their buffers (asynchronous on CUDA; nothing on the CPU)."""
        if not self.staged:
            return
        stream = torch.cuda.current_stream(self.device)
        for name in names:
            self[name].copy_(self._twin(name, "in"), non_blocking=True)
            if name not in self._uploaded:
                self._uploaded[name] = torch.cuda.Event()
            self._uploaded[name].record(stream)

    def download(self, name: str) -> torch.Tensor:
        """Buffer `name` on the host: its pinned twin after a synchronized copy (CUDA), the buffer itself
        (CPU); valid until the next download or replay (module docstring)."""
        if not self.staged:
            return self[name]
        twin = self._twin(name, "out")
        twin.copy_(self[name])
        return twin

    def read(self, name: str) -> torch.Tensor:
        """A copy of a buffer's contents (safe to keep after the next replay overwrites the buffer)."""
        return self[name].clone()

    def zero_(self, role: Role | None = None) -> None:
        for name in self.names(role):
            self.tensors[name].zero_()
