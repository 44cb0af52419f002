"""Registry of benchmarkable frontends and the adapter protocol they implement.

How a frontend becomes benchmarkable (`flashrt bench NAME`):

1. Write an adapter class with the `Benchmark` protocol below, and a factory
   `make_benchmark(profile, checkpoint, device) -> Benchmark`. The factory does all the setup (load
   weights or build the tiny preset named by `profile.shapes.preset`, allocate buffers, capture graphs)
   and reports the time of each setup phase in `adapter.cold_start_ms` ({"load": ms, "capture": ms,
   "calibration": ms, ...}). It may raise ConfigError for bad `profile.model` keys.
2. Register it in `flashrt/frontends/<family>/bench.py` (found automatically: the registry imports
   every `flashrt.frontends.*.bench` module on first lookup), e.g.

       from flashrt.bench.registry import register_benchmark
       register_benchmark("pi0", make_benchmark, description="Pi0 policy, one chunk per call")

   or call `register_benchmark` from any module imported before the bench runs.

The `Benchmark` protocol (methods in parentheses are optional):

- `name: str`, `device: str` ("cpu" / "cuda").
- `make_inputs(trace_seed) -> list[inputs]`: the trace, deterministic in the seed (length
  `profile.bench.trace_len`). Inputs are whatever `run` takes: dicts of arrays/tensors, strings ...
- `run(inputs, timer) -> outputs`: one hot-path call, stages wrapped in `with timer.stage(NAME):`
  using the names in `STAGES` where they apply. Outputs are compared with the reference's, so return
  host tensors/arrays (or dicts/lists of them). An exception counts as a failed call.
- `reference(name) -> Implementation`: a second implementation on the same weights, with the same
  `run(inputs, timer)`. Names: "eager" (our model without capture), "compile" (under
  torch.compile), or a reference package ("lerobot", "transformers", "vocos", "bigvgan", "snac", ...).
  Raise `ReferenceUnavailable("why")` when it cannot be built here (package not installed ...).
- `flops_bytes() -> (flops, bytes)` per call (weights + activations read/written).
- (`memory() -> dict[str, int]`): buffer totals in bytes, e.g. {"buffers": n, "weights": n}.
- (`policy() -> object with step(obs)`, optionally `reset()`): for `flashrt loop`.
- (`close()`): release resources at the end.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from flashrt.errors import ConfigError, FlashRTError
from flashrt.profile.timers import StageTimer

STAGES = ("validate", "h2d", "replay", "d2h", "postprocess")
"""Canonical stage names: validate/preprocess, host->device, replay, device->host, postprocess."""

_DISCOVER_PACKAGES = ("flashrt.bench.adapters",)
_BUILTIN_MODULES = ("flashrt.bench.runtime_block",)


class ReferenceUnavailable(FlashRTError):
    """A reference implementation cannot be built here (package missing, unsupported setting)."""


@runtime_checkable
class Implementation(Protocol):
    name: str

    def run(self, inputs: Any, timer: StageTimer) -> Any: ...


@runtime_checkable
class Benchmark(Implementation, Protocol):
    device: str

    def make_inputs(self, trace_seed: int) -> list[Any]: ...

    def reference(self, name: str) -> Implementation: ...

    def flops_bytes(self) -> tuple[float, float]: ...


Factory = Callable[..., Benchmark]


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Factory
    description: str = ""


_REGISTRY: dict[str, Entry] = {}
_DISCOVERY_ERRORS: dict[str, str] = {}
_DISCOVERED: list[bool] = []


def register_benchmark(name: str, factory: Factory, description: str = "", replace: bool = False) -> None:
    """Make `flashrt bench NAME` build its adapter with `factory(profile, checkpoint, device)`."""
    if name in _REGISTRY and not replace and _REGISTRY[name].factory is not factory:
        raise ValueError(f"benchmark {name!r} is already registered by {_REGISTRY[name].factory!r}")
    _REGISTRY[name] = Entry(name, factory, description)


def unregister_benchmark(name: str) -> None:
    _REGISTRY.pop(name, None)


def _import_quietly(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken frontend must not hide the others; it is reported by list
        _DISCOVERY_ERRORS[module] = f"{type(exc).__name__}: {exc}"


def discover() -> dict[str, str]:
    """Import the built-in benchmarks and every module of `flashrt.bench.adapters` (once); returns
    {module: error} for those that failed to import."""
    if not _DISCOVERED:
        _DISCOVERED.append(True)
        for module in _BUILTIN_MODULES:
            _import_quietly(module)
        for package in _DISCOVER_PACKAGES:
            _discover_package(package)
    return dict(_DISCOVERY_ERRORS)


def _discover_package(package: str) -> None:
    try:
        pkg = importlib.import_module(package)
    except ImportError:
        return
    for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
        _import_quietly(f"{package}.{info.name}")


def available() -> dict[str, Entry]:
    """Every registered benchmark, after discovery."""
    discover()
    return dict(sorted(_REGISTRY.items()))


def get_benchmark(name: str) -> Entry:
    """The registry entry for `name`; ConfigError listing the known names otherwise."""
    entries = available()
    if name not in entries:
        failed = "; ".join(f"{m}: {e}" for m, e in _DISCOVERY_ERRORS.items())
        raise ConfigError(f"no benchmark named {name!r}; registered: {sorted(entries)}"
                          + (f" (failed to import: {failed})" if failed else ""))
    return entries[name]
