"""Graph backends behind one interface: `backend.capture(fn, buffers) -> Graph`, `graph.replay()`.

The contract every frontend is written against (it must work unchanged on every backend):

* `fn()` takes no arguments. It reads static input buffers (and weights) and writes its results INTO
  static output buffers (`copy_`, `out=`, slice assignment). Its return value is ignored: a replay
  returns nothing, results are read from the output buffers.
* Python runs only at capture. Python values (ints, flags, the step counter of a loop) are frozen
  into the graph; anything that changes from call to call must live in a static buffer.
* Randomness enters through static input buffers (e.g. a `noise` buffer filled outside the graph).

Backends (registry by name, `get_backend(name, **opts)`; add more with `register_backend`):

    eager  a plain call of fn on every replay: debugging, and the fast CPU default
    trace  CPU stand-in for a CUDA graph: records the aten op program at capture, refusing what a
           CUDA graph cannot hold (host syncs, data-dependent shapes, RNG), replays it bit for bit
           (`flashrt.runtime.trace`)
    cuda   `torch.cuda.CUDAGraph` with side-stream warm-up and one memory pool per backend instance
           (`flashrt.runtime.cuda_graph`)
    jit    the step traced into a TorchScript graph over its buffers, replayed by TorchScript's
           interpreter with the GIL released: half eager's host time on small CPU steps
           (`flashrt.runtime.jit`)
    onnxrt the step exported to ONNX (export cache) and run by onnxruntime, IO-bound to the buffers
           (`flashrt.runtime.onnxrt`)
    tensorrt  the same ONNX export built into one TensorRT engine per capture (engine cached beside the
           export), run on the buffers' addresses on the current CUDA stream; needs CUDA + tensorrt
           (`flashrt.runtime.tensorrt`)

Ownership and lifetime of a Graph: the frontend that captured it owns it, together with the Buffers
it was captured against and the module's weights. The graph stays valid only while those tensors
keep their storage: writing into them (populate, `copy_`) is how inputs change between replays,
but replacing or resizing a buffer or a weight after capture (`buffers.tensors[n] = ...`,
`module.to(...)`, `load_state_dict(assign=True)`) detaches the graph: a CUDA graph would then read
and write freed memory, a trace graph stale tensors. Graphs that hold `buffers` check their storage
on every replay (`check_buffers=True`, the default of the graph backends) and raise CaptureError
naming the buffer that moved; weights are not checked. Re-capture to pick up new storage.

What the output buffers hold right after capture differs by backend (eager: untouched, trace: one
real run, cuda: the warm-up runs); always replay before reading.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from flashrt.errors import CaptureError, ConfigError
from flashrt.runtime.buckets import FallbackCounter, GraphSet, length_mask, pad_to

__all__ = [
    "Graph",
    "GraphBackend",
    "EagerBackend",
    "EagerGraph",
    "BufferGuard",
    "GraphSet",
    "FallbackCounter",
    "pad_to",
    "length_mask",
    "named_tensors",
    "register_backend",
    "get_backend",
    "backend_for_device",
    "backend_names",
    "backend_needs",
    "backends_for",
]

CaptureFn = Callable[[], Any]


@runtime_checkable
class Graph(Protocol):
    """A captured forward. `replay(times)` re-runs it ``times`` times in a row (default once) against the
    static buffers it was captured with; a backend may run them in one call (`flashrt.runtime.jit`: the
    GIL handed back once for them all)."""

    backend: str

    def replay(self, times: int = 1) -> None: ...


@runtime_checkable
class GraphBackend(Protocol):
    """Turns a no-argument fn into a Graph."""

    name: str

    def capture(self, fn: CaptureFn, buffers: Any = None) -> Graph: ...


def named_tensors(buffers: Any) -> dict[str, torch.Tensor]:
    """The named static tensors of `buffers`: None, a Mapping[str, Tensor], or a `Buffers` object."""
    if buffers is None:
        return {}
    source = getattr(buffers, "tensors", buffers)
    if not isinstance(source, Mapping):
        raise TypeError(f"buffers must be a Buffers object or a mapping of tensors, got {type(buffers)}")
    return {str(k): v for k, v in source.items() if isinstance(v, torch.Tensor)}


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class BufferGuard:
    """Remembers where each named buffer lived at capture; `check()` names any that moved since."""

    def __init__(self, buffers: Any) -> None:
        self._source = buffers
        self._keys = {n: _storage_key(t) for n, t in named_tensors(buffers).items()}

    @property
    def names(self) -> list[str]:
        return list(self._keys)

    def moved(self) -> list[str]:
        now = named_tensors(self._source)
        return [n for n, key in self._keys.items() if n not in now or _storage_key(now[n]) != key]

    def check(self) -> None:
        moved = self.moved()
        if moved:
            raise CaptureError(
                f"buffer(s) {moved} were reallocated or reshaped after capture; the graph still points at "
                "the old storage. Write into buffers (populate/copy_) instead of replacing them, "
                "or capture again."
            )


class EagerGraph:
    """A plain call of fn under no_grad on every replay. Owns nothing; valid as long as fn is."""

    backend = "eager"

    def __init__(self, fn: CaptureFn, guard: BufferGuard | None = None) -> None:
        self._fn = fn
        self._guard = guard

    def replay(self, times: int = 1) -> None:
        if self._guard is not None:
            self._guard.check()
        with torch.no_grad():
            for _ in range(times):
                self._fn()

    def check(self) -> None:
        if self._guard is not None:
            self._guard.check()


class EagerBackend:
    """No capture at all: `capture` wraps fn without running it; `replay` calls it."""

    name = "eager"

    def __init__(self, check_buffers: bool = False) -> None:
        self.check_buffers = check_buffers

    def capture(self, fn: CaptureFn, buffers: Any = None) -> EagerGraph:
        if not callable(fn):
            raise CaptureError(f"capture needs a no-argument callable, got {type(fn).__name__}")
        return EagerGraph(fn, BufferGuard(buffers) if self.check_buffers else None)


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: a factory (or "module:attr" path resolved on first use) and its devices."""

    name: str
    factory: Callable[..., GraphBackend] | str
    devices: tuple[str, ...]
    doc: str = ""
    takes_device: bool = False
    needs: str = ""  # what it needs beyond its device type, said in refusals ("CUDA + tensorrt")

    def build(self, **opts: Any) -> GraphBackend:
        factory = self.factory
        if isinstance(factory, str):
            module, attr = factory.split(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(**opts)


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(
    name: str,
    factory: Callable[..., GraphBackend] | str,
    *,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    doc: str = "",
    replace: bool = False,
    takes_device: bool = False,
    needs: str = "",
) -> None:
    """Add a backend under `name`. `devices` lists the device types it runs on, preferred first;
    `takes_device`: its factory accepts ``device=`` (`backend_for_device` passes the frontend's);
    `needs`: what else it needs, named when it is refused (its factory checks and raises)."""
    if name in _REGISTRY and not replace:
        raise ConfigError(f"graph backend {name!r} is already registered (pass replace=True to override)")
    _REGISTRY[name] = BackendEntry(name, factory, tuple(devices), doc, takes_device, needs)


def get_backend(name: str, **opts: Any) -> GraphBackend:
    """Build the backend registered as `name` with its options (e.g. `get_backend("cuda", warmup=2)`)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown graph backend {name!r}; known: {backend_names()}")
    try:
        return entry.build(**opts)
    except TypeError as exc:
        raise ConfigError(f"graph backend {name!r}: bad options {sorted(opts)} ({exc})") from None


def backend_for_device(name: str | None, device: torch.device, **opts: Any) -> GraphBackend:
    """The backend `name` (None: the device's preferred one, `cuda` on a GPU, `eager` otherwise) built
    for `device`: a backend that runs on one device (cuda) gets the frontend's own device, so a
    frontend on cuda:1 is captured on cuda:1. A backend that does not run on the device's type is a
    ConfigError naming the ones that do.

    The CPU default is `eager` for every family (Pi0/Pi0.5, GR00T, the vocoders, the TTS models). The rule
    a family's CPU default follows (docs/benchmarks/runtime.md, "onnxrt vs eager on the CPU"): another
    backend becomes a family's default only when, at its `cpu-small` size, it is faster than eager in
    interleaved pairs at 1 and at 2 threads, matches eager to 1e-5 (streamed too, for a vocoder), and
    its costs the bench does not time are paid for: onnxrt exports and holds one copy of the weights per
    bucket (a vocoder's ladder has ~15), and runs a call padded to its bucket (up to 25 % more frames)
    where eager runs the exact length. No family has met it in the measurements there."""
    device = torch.device(device)
    name = name or ("cuda" if device.type == "cuda" else "eager")
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown graph backend {name!r}; known: {backend_names()}")
    if device.type not in entry.devices:
        raise ConfigError(f"graph backend {name!r} does not run on {device.type}{backend_needs(name)}; "
                          f"use one of {backends_for(device.type)}")
    if entry.takes_device:
        opts.setdefault("device", device)
    return get_backend(name, **opts)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def backend_needs(name: str) -> str:
    """The text ' (needs CUDA + tensorrt)' for a backend that needs more than its device type, else ''."""
    entry = _REGISTRY.get(name)
    return f" (needs {entry.needs})" if entry is not None and entry.needs else ""


def backends_for(device_type: str) -> list[str]:
    """Registered backends that run on `device_type` ("cpu", "cuda"), preferred first."""
    ranked = [(e.devices.index(device_type), i, e.name) for i, e in enumerate(_REGISTRY.values())
              if device_type in e.devices]
    return [name for _, _, name in sorted(ranked)]


register_backend("cuda", "flashrt.runtime.cuda_graph:CudaBackend", devices=("cuda",),
                 doc="torch.cuda.CUDAGraph, side-stream warm-up, shared memory pool", takes_device=True)
register_backend("eager", EagerBackend, devices=("cpu", "cuda", "meta"),
                 doc="plain call of fn; debugging and the fast CPU default (on meta: kernel counting)")
register_backend("trace", "flashrt.runtime.trace:TraceBackend", devices=("cpu", "cuda"),
                 doc="CPU stand-in: recorded aten program, refuses what a CUDA graph cannot hold")
register_backend("onnxrt", "flashrt.runtime.onnxrt:OnnxRuntimeBackend", devices=("cpu", "cuda"),
                 doc="the step exported to ONNX (cached), run by onnxruntime with IO binding on the buffers",
                 takes_device=True)
register_backend("jit", "flashrt.runtime.jit:JitBackend", devices=("cpu",),
                 doc="the step traced into TorchScript over its buffers, replayed without Python (GIL free)")
register_backend("tensorrt", "flashrt.runtime.tensorrt:TensorRTBackend", devices=("cuda",),
                 doc="the ONNX export built into a TensorRT engine per capture (cached), run on the buffers' "
                     "addresses on the current stream; CUDA-graph capturable", takes_device=True,
                 needs="CUDA + tensorrt")
