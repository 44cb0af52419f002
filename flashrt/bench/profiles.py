"""Deployment/benchmark profiles: TOML files in `profiles/`, read into frozen dataclasses.

A profile fixes everything a measurement depends on except the model weights: device class, precision,
shapes, graph backend, warm-up, trace, target rate and the quality-gate tolerance. Unknown keys and bad
values are refused with a ConfigError naming the file and the key. Layout (every key optional except
`device.kind`; defaults shown where they exist):

    description = "..."
    precision = "fp32"            # fp32 | bf16 | fp16 | fp8 | int8
    [device]
    kind = "cpu"                  # cpu | cuda
    model = "any"                 # any | h100 | h200 | rtx4090 | rtx5090 | orin | thor
    threads = 0                   # CPU threads for torch during the run (0 = leave as is)
    [shapes]
    preset = "tiny"               # model size preset (a benchmark may ignore it with a checkpoint)
    batch = 1
    buckets = []                  # shape buckets (prompt length, audio chunk, ...)
    views = 0 / chunk = 0 / steps = 0   # 0 = the model's own value
    [runtime]
    backend = "eager"             # a registered graph backend that runs on device.kind (eager | trace |
                                  # onnxrt on cpu; cuda | tensorrt | eager | trace | onnxrt on cuda)
    [bench]
    warmup = 10, iters = 200, trace_len = 16, seed = 0, target_rate_hz = 50.0, soak_steps = 10000
    [quality]
    reference = "eager", atol = 1e-4, rtol = 1e-4
    [model]                       # free keys handed to the benchmark factory, which validates them
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from flashrt.errors import ConfigError, DeviceError
from flashrt.io.files import read_toml
from flashrt.resources import data_dir

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8")
DEVICE_KINDS = ("cpu", "cuda")
DEVICE_MODELS = ("any", "h100", "h200", "rtx4090", "rtx5090", "orin", "thor")


@dataclass(frozen=True)
class DeviceSection:
    kind: str = "cpu"
    model: str = "any"
    threads: int = 0
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"kind": DEVICE_KINDS, "model": DEVICE_MODELS}
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("threads",)
    AT_MOST: ClassVar[dict[str, float]] = {"threads": 4096}

    def check(self) -> None:
        if self.kind == "cpu" and self.model != "any":
            raise ValueError("model: a cpu profile takes model = 'any'")


@dataclass(frozen=True)
class ShapesSection:
    preset: str = "tiny"
    batch: int = 1
    buckets: tuple[int, ...] = ()
    views: int = 0
    chunk: int = 0
    steps: int = 0
    POSITIVE: ClassVar[tuple[str, ...]] = ("batch", "buckets")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("views", "chunk", "steps")
    AT_MOST: ClassVar[dict[str, float]] = {"batch": 4096, "buckets": 1 << 20, "views": 64, "chunk": 10_000,
                                           "steps": 1000}

    def check(self) -> None:
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError("buckets: must be strictly increasing")


@dataclass(frozen=True)
class RuntimeSection:
    backend: str = "eager"

    def check(self) -> None:
        from flashrt.runtime.graphs import backend_names

        if self.backend not in backend_names():
            raise ValueError(f"backend: {self.backend!r} is not one of {backend_names()}")


@dataclass(frozen=True)
class BenchSection:
    warmup: int = 10
    iters: int = 200
    trace_len: int = 16
    seed: int = 0
    target_rate_hz: float = 50.0
    soak_steps: int = 10_000
    POSITIVE: ClassVar[tuple[str, ...]] = ("iters", "trace_len", "target_rate_hz", "soak_steps")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("warmup",)
    AT_MOST: ClassVar[dict[str, float]] = {"warmup": 1_000_000, "iters": 10_000_000, "trace_len": 100_000,
                                           "target_rate_hz": 100_000.0, "soak_steps": 100_000_000}


@dataclass(frozen=True)
class QualitySection:
    reference: str = "eager"
    atol: float = 1e-4
    rtol: float = 1e-4
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("atol", "rtol")


@dataclass(frozen=True)
class Profile:
    """One profile file, validated. `model` holds the free `[model]` table for the factory."""

    name: str
    description: str = ""
    precision: str = "fp32"
    device: DeviceSection = field(default_factory=DeviceSection)
    shapes: ShapesSection = field(default_factory=ShapesSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    bench: BenchSection = field(default_factory=BenchSection)
    quality: QualitySection = field(default_factory=QualitySection)
    model: dict[str, Any] = field(default_factory=dict)
    path: str = ""
    def check(self) -> None:
        from flashrt.runtime.graphs import backend_needs, backends_for

        runs_here = backends_for(self.device.kind)
        if self.runtime.backend not in runs_here:
            raise ValueError(f"runtime.backend: {self.runtime.backend!r} does not run on device.kind = "
                             f"{self.device.kind!r}{backend_needs(self.runtime.backend)} "
                             f"(backends there: {runs_here})")

    def with_overrides(self, **sections: dict[str, Any]) -> Profile:
        """A copy with some section keys replaced, e.g. `with_overrides(bench={"iters": 20})`;
        validated like a file (ConfigError on unknown keys or bad values)."""
        changes = {}
        for section, values in sections.items():
            current = getattr(self, section)
            merged = {f.name: getattr(current, f.name) for f in fields(current)} | values
            changes[section] = _build(type(current), merged, f"{self.path or self.name}: [{section}]")
        return replace(self, **changes)

    def with_precision(self, precision: str) -> Profile:
        """A copy running ``precision`` (one of `PRECISIONS`; ConfigError otherwise)."""
        if precision not in PRECISIONS:
            raise ConfigError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
        return replace(self, precision=precision)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": self.path, "description": self.description,
                               "precision": self.precision}
        for section in ("device", "shapes", "runtime", "bench", "quality"):
            value = getattr(self, section)
            out[section] = {f.name: getattr(value, f.name) for f in fields(value)}
        out["model"] = dict(self.model)
        return out


_SECTIONS = {"device": DeviceSection, "shapes": ShapesSection, "runtime": RuntimeSection,
             "bench": BenchSection, "quality": QualitySection}
_TOP_LEVEL = ("name", "description", "precision", "model", *_SECTIONS)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        return isinstance(value, list | tuple) and all(_type_ok(v, inner) for v in value)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _check_value(cls: type, key: str, value: Any, hint: Any) -> None:
    if not _type_ok(value, hint):
        raise ValueError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    choices = getattr(cls, "CHOICES", {}).get(key)
    if choices and value not in choices:
        raise ValueError(f"{key}: {value!r} is not one of {list(choices)}")
    items = value if isinstance(value, list | tuple) else [value]
    if key in getattr(cls, "POSITIVE", ()) and any(v <= 0 for v in items):
        raise ValueError(f"{key}: must be > 0, got {value!r}")
    if key in getattr(cls, "NON_NEGATIVE", ()) and any(v < 0 for v in items):
        raise ValueError(f"{key}: must be >= 0, got {value!r}")
    most = getattr(cls, "AT_MOST", {}).get(key)
    if most is not None and any(v > most for v in items):
        raise ValueError(f"{key}: {value!r} is beyond the sane limit {most}")


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {known}")
    try:
        for key, value in table.items():
            _check_value(cls, key, value, hints[key])
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
        obj = cls(**values)
        getattr(obj, "check", lambda: None)()
    except ValueError as exc:
        raise ConfigError(f"{where}: bad value for {exc}") from None
    return obj


def _check_model_table(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [model] must be a table")
    for key, value in table.items():
        leaves = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str | int | float | bool) for v in leaves):
            raise ConfigError(f"{where}: bad value for model.{key}: scalars or lists of scalars only")
    return dict(table)


def parse_profile(data: dict[str, Any], name: str, path: str = "") -> Profile:
    """Validate a TOML table (already parsed) into a Profile; ConfigError names `path` and the key."""
    where = path or name
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {list(_TOP_LEVEL)}")
    if "name" in data and data["name"] != name:
        raise ConfigError(f"{where}: bad value for name: {data['name']!r} must match the file name {name!r}")
    sections = {}
    for key, cls in _SECTIONS.items():
        table = data.get(key, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{key}] must be a table, got {table!r}")
        sections[key] = _build(cls, table, f"{where}: [{key}]")
    top = {k: data[k] for k in ("description", "precision") if k in data}
    top = {f.name: getattr(v, f.name) for v in [_build(_Top, top, where)] for f in fields(v)}
    model = _check_model_table(data.get("model", {}), where)
    profile = Profile(name=name, path=path, model=model, **top, **sections)
    try:
        profile.check()
    except ValueError as exc:
        raise ConfigError(f"{where}: bad value for {exc}") from None
    return profile


@dataclass(frozen=True)
class _Top:
    description: str = ""
    precision: str = "fp32"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"precision": PRECISIONS}


def list_profiles(folder: Path | None = None) -> dict[str, Path]:
    """name -> path of every profile in `folder` (the shipped `profiles/` by default)."""
    folder = folder or data_dir("profiles")
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`cpu-tiny`) or any TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        known = list_profiles()
        if str(name_or_path) not in known:
            raise ConfigError(f"no profile named {str(name_or_path)!r}; shipped profiles: {sorted(known)}")
        path = known[str(name_or_path)]
    data = read_toml(path, "profile", ConfigError)
    return parse_profile(data, path.stem, str(path))


def check_device(profile: Profile) -> str:
    """Refuse (DeviceError) a profile this machine cannot run; return the device string to use."""
    if profile.device.kind == "cpu":
        return "cpu"
    import torch

    from flashrt.bench.roofline import detect_model

    if not torch.cuda.is_available():
        raise DeviceError(f"profile {profile.name!r} needs a CUDA device ({profile.device.model}); "
                          "this machine has none. Run it where such a device exists, "
                          "or use cpu-tiny/cpu-small.")
    found = detect_model(torch.cuda.get_device_name(0))
    if profile.device.model not in ("any", found):
        raise DeviceError(f"profile {profile.name!r} is for {profile.device.model}; this machine has "
                          f"{torch.cuda.get_device_name(0)!r} ({found}). Pick the profile of this device.")
    return "cuda"
