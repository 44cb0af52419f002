"""Precision specs: which dtype each tensor class uses, how it is scaled, and whether a device can run it.

A `PrecisionSpec` is pure data (frozen, hashable, canonical dict form for cache keys and profiles). It
names a dtype for each tensor class:

    weights      GEMM weights, (out_features, in_features)
    activations  GEMM inputs, (..., in_features)
    kv           the attention key/value cache
    compute      everything else (norms, residual stream, attention math, GEMM outputs)

Quantized classes (fp8_e4m3, int8) carry a granularity ("per_tensor" | "per_channel") and a scale
source:

    "none"        not quantized (fp32 / bf16 / fp16 tensors)
    "calibrated"  a static scale from the calibration cache (collected offline, see calibrate.py)
    "dynamic"     computed from the tensor itself when it is quantized: at load time for weights,
                  at every call for activations

Device rules (`validate`), decided here and pinned by tests:
- CPU: fp32 and bf16 run natively. fp16 is allowed but logged as a warning (most CPUs emulate half
  matmuls, so it is slower than fp32 and less accurate than bf16; it exists for parity checks).
  For this spec, fp8_e4m3 and int8 run only through the pure-torch reference ops (`reference=True`):
  they simulate the arithmetic (quantize, dequantize, fp32 GEMM) so quality can be measured. The
  quantized model path (`precision="int8"|"fp8"` of a family that lists them in `compute_dtype`) runs
  `flashrt.quant.linear` instead: int8 through real int8 GEMMs, fp8 as an exact emulation.
- CUDA: bf16 needs sm80+, fp8_e4m3 needs sm89+ (Ada, Hopper, Blackwell), int8 GEMMs need sm75+.
  With `reference=True` the reference ops run on any CUDA device.
- Other device types: only fp32 (and the reference path) are accepted.
Combination rules (device independent):
- per-channel scales exist for weights only (output channels). Per-channel activations would scale the
  reduction dimension, which cannot be factored out of the GEMM; activations and kv are per_tensor.
- quantized activations need quantized weights of the same dtype (one GEMM input type).
- scale source "none" exactly when the dtype is not quantized.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrt.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DTypeInfo:
    """One storage dtype: its torch dtype, the largest representable magnitude if quantized."""

    name: str
    torch_dtype: torch.dtype
    qmax: float | None = None
    cuda_min_sm: tuple[int, int] = (0, 0)

    @property
    def quantized(self) -> bool:
        return self.qmax is not None


DTYPES: dict[str, DTypeInfo] = {
    "fp32": DTypeInfo("fp32", torch.float32),
    "bf16": DTypeInfo("bf16", torch.bfloat16, cuda_min_sm=(8, 0)),
    "fp16": DTypeInfo("fp16", torch.float16),
    "fp8_e4m3": DTypeInfo("fp8_e4m3", torch.float8_e4m3fn, qmax=448.0, cuda_min_sm=(8, 9)),
    "int8": DTypeInfo("int8", torch.int8, qmax=127.0, cuda_min_sm=(7, 5)),
}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
            "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}
GRANULARITIES = ("per_tensor", "per_channel")
SCALE_SOURCES = ("none", "calibrated", "dynamic")


def dtype_info(name: str) -> DTypeInfo:
    """The DTypeInfo of a dtype name or alias ('fp8' -> 'fp8_e4m3'); ConfigError if unknown."""
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; known: {sorted(DTYPES)} (aliases: {sorted(_ALIASES)})")
    return DTYPES[key]


COMPUTE_PRECISIONS = ("fp32", "bf16", "fp16")
QUANTIZED_PRECISIONS = ("int8", "fp8_e4m3")  # the names a family that installs quantized GEMMs accepts


def quantized_kind(precision: str | torch.dtype) -> str | None:
    """"int8" / "fp8" for a quantized precision name (aliases included), None for a float one."""
    if isinstance(precision, torch.dtype) or not isinstance(precision, str):
        return None
    key = _ALIASES.get(precision, precision)
    return {"int8": "int8", "fp8_e4m3": "fp8"}.get(key)


def compute_dtype(precision: str | torch.dtype, quantized: tuple[str, ...] = ()) -> torch.dtype:
    """The one precision vocabulary of every loader (`load_policy`, `load_vocoder`, profiles, the CLI).

    Accepts a torch floating dtype or a name from `DTYPES` or its aliases ("float32" = "fp32",
    "bfloat16" = "bf16", "float16" = "half" = "fp16", "fp8" = "fp8_e4m3"). A float name gives its
    dtype. A quantized name ("int8", "fp8_e4m3") is accepted only where the caller lists it in
    `quantized` (a family that installs quantized kernels) and then gives the float32 compute dtype of
    the unquantized parts; anywhere else it is a ConfigError saying what is supported."""
    allowed = [*COMPUTE_PRECISIONS, *quantized]
    if isinstance(precision, torch.dtype):
        for name in COMPUTE_PRECISIONS:
            if DTYPES[name].torch_dtype == precision:
                return precision
        raise ConfigError(f"precision {precision} is not supported; use one of {allowed} "
                          f"(aliases: {sorted(_ALIASES)})")
    if not isinstance(precision, str) or _ALIASES.get(precision, precision) not in DTYPES:
        raise ConfigError(f"unknown precision {precision!r}; use one of {allowed} "
                          f"(aliases: {sorted(_ALIASES)})")
    info = dtype_info(precision)
    if info.quantized and info.name not in quantized:
        raise ConfigError(f"precision {precision!r} is not supported here; use one of {allowed}")
    return torch.float32 if info.quantized else info.torch_dtype


@dataclass(frozen=True)
class TensorSpec:
    """Precision of one tensor class: dtype name, granularity and scale source."""

    dtype: str = "fp32"
    granularity: str = "per_tensor"
    scale: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_info(self.dtype).name)
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("scale", self.scale, SCALE_SOURCES)
        _check_tensor_spec(self)

    @property
    def info(self) -> DTypeInfo:
        return DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.info.quantized

    def describe(self) -> str:
        if not self.quantized:
            return self.dtype
        return f"{self.dtype}/{self.granularity}/{self.scale}"


def _check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {list(allowed)}")


def _check_tensor_spec(spec: TensorSpec) -> None:
    if spec.quantized and spec.scale == "none":
        raise ConfigError(f"{spec.dtype} is quantized and needs a scale source ('calibrated' or 'dynamic')")
    if not spec.quantized and spec.scale != "none":
        raise ConfigError(f"{spec.dtype} is not quantized; its scale source must be 'none', "
                          f"not {spec.scale!r}")
    if not spec.quantized and spec.granularity != "per_tensor":
        raise ConfigError(f"{spec.dtype} is not quantized; granularity {spec.granularity!r} means nothing")


def _float(dtype: str) -> TensorSpec:
    return TensorSpec(dtype)


@dataclass(frozen=True)
class PrecisionSpec:
    """Dtype, granularity and scale source per tensor class (see the module docstring for the rules)."""

    weights: TensorSpec = field(default_factory=TensorSpec)
    activations: TensorSpec = field(default_factory=TensorSpec)
    kv: TensorSpec = field(default_factory=TensorSpec)
    compute: str = "fp32"
    name: str = ""

    def __post_init__(self) -> None:
        info = dtype_info(self.compute)
        if info.quantized:
            raise ConfigError(f"compute dtype must be fp32, bf16 or fp16, not {self.compute!r}")
        object.__setattr__(self, "compute", info.name)
        _check_combination(self)

    @classmethod
    def named(cls, name: str) -> PrecisionSpec:
        """A preset: 'fp32', 'bf16', 'fp16', 'fp8', 'int8'."""
        if name not in PRESETS:
            raise ConfigError(f"unknown precision preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionSpec:
        """Build from a profile table: {"preset": ...} or explicit classes; unknown keys are refused."""
        return _from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (reports, profiles); `from_dict(to_dict())` round-trips."""
        return dataclasses.asdict(self)

    def cache_fields(self) -> dict[str, Any]:
        """What changes the scales, for cache keys: everything but the display name."""
        fields = self.to_dict()
        del fields["name"]
        return fields

    @property
    def quantized(self) -> bool:
        return any(t.quantized for t in (self.weights, self.activations, self.kv))

    def tensor_dtypes(self) -> tuple[str, ...]:
        return (self.weights.dtype, self.activations.dtype, self.kv.dtype, self.compute)

    def describe(self) -> str:
        return (f"W {self.weights.describe()} · A {self.activations.describe()} · "
                f"KV {self.kv.describe()} · compute {self.compute}")

    def validate(self, device: str | torch.device = "cpu", *, reference: bool = False,
                 capability: tuple[int, int] | None = None) -> PrecisionSpec:
        """Refuse (DeviceError) what `device` cannot run; returns self.

        `reference=True` accepts the pure-torch reference ops for quantized dtypes on any device.
        `capability` overrides the CUDA compute capability query (for planning on another machine).
        """
        dev = torch.device(device)
        rule = _DEVICE_RULES.get(dev.type, _other_device_rule)
        rule(self, dev, reference, capability)
        return self


def _check_combination(spec: PrecisionSpec) -> None:
    for cls_name in ("activations", "kv"):
        if getattr(spec, cls_name).granularity == "per_channel":
            raise ConfigError(
                f"per_channel {cls_name} are unsupported: channel scales on a GEMM input scale the "
                "reduction dimension and cannot be factored out; use per_tensor")
    a, w = spec.activations, spec.weights
    if a.quantized and a.dtype != w.dtype:
        raise ConfigError(f"quantized activations ({a.dtype}) need weights of the same dtype, got {w.dtype}")


def _from_dict(data: dict[str, Any]) -> PrecisionSpec:
    data = dict(data)
    preset = data.pop("preset", None)
    allowed = {f.name for f in dataclasses.fields(PrecisionSpec)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"unknown precision keys {unknown}; allowed: {sorted(allowed | {'preset'})}")
    base = PrecisionSpec.named(preset) if preset is not None else PrecisionSpec()
    changes = {k: _tensor_spec(k, v) if k in ("weights", "activations", "kv") else v for k, v in data.items()}
    if changes and "name" not in changes:
        changes["name"] = ""  # a modified preset is no longer that preset
    return dataclasses.replace(base, **changes)


def _tensor_spec(cls_name: str, value: Any) -> TensorSpec:
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, str):
        return TensorSpec(value)
    if not isinstance(value, dict):
        raise ConfigError(f"precision.{cls_name} must be a dtype name or a table, got {value!r}")
    allowed = {f.name for f in dataclasses.fields(TensorSpec)}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"unknown keys {unknown} in precision.{cls_name}; allowed: {sorted(allowed)}")
    return TensorSpec(**value)


# ---------------------------------------------------------------------------------------------- devices


def _refuse_quantized_without_reference(spec: PrecisionSpec, where: str, reference: bool) -> None:
    quantized = sorted({t.dtype for t in (spec.weights, spec.activations, spec.kv) if t.quantized})
    if quantized and not reference:
        raise DeviceError(
            f"{'/'.join(quantized)} cannot run natively on {where} (precision: {spec.describe()}). "
            "Use the CPU reference path (validate(..., reference=True), for quality checks only), "
            "pick precision 'bf16' or 'fp32', or run on a CUDA device that supports it")


def _cpu_rule(spec: PrecisionSpec, dev: torch.device, reference: bool, capability) -> None:
    _refuse_quantized_without_reference(spec, "the CPU", reference)
    if "fp16" in spec.tensor_dtypes():
        log.warning("fp16 on CPU is emulated by most processors: expect it slower than fp32 and less "
                    "accurate than bf16 (precision: %s)", spec.describe())


def _cuda_rule(spec: PrecisionSpec, dev: torch.device, reference: bool, capability) -> None:
    sm = capability if capability is not None else cuda_capability(dev)
    needed = {d: DTYPES[d].cuda_min_sm for d in spec.tensor_dtypes()}
    if reference:
        needed = {d: m for d, m in needed.items() if not DTYPES[d].quantized}
    too_new = sorted(d for d, m in needed.items() if tuple(sm) < m)
    if too_new:
        reqs = ", ".join(f"{d} needs sm{m[0]}{m[1]}+" for d, m in sorted(needed.items()) if d in too_new)
        raise DeviceError(f"{dev} is sm{sm[0]}{sm[1]}; {reqs} (precision: {spec.describe()}). "
                          "Pick a lower precision preset (e.g. 'fp16') or another GPU")


def _other_device_rule(spec: PrecisionSpec, dev: torch.device, reference: bool, capability) -> None:
    _refuse_quantized_without_reference(spec, f"device type {dev.type!r}", reference)
    unsupported = sorted({d for d in spec.tensor_dtypes() if not DTYPES[d].quantized} - {"fp32"})
    if unsupported:
        raise DeviceError(f"flashrt supports only fp32 on device type {dev.type!r}; {unsupported} refused")


_DEVICE_RULES = {"cpu": _cpu_rule, "cuda": _cuda_rule}


def cuda_capability(device: str | torch.device = "cuda") -> tuple[int, int]:
    """(major, minor) compute capability; DeviceError when CUDA is not available."""
    if not torch.cuda.is_available():
        raise DeviceError(f"{device} requested but torch.cuda.is_available() is False "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


# ---------------------------------------------------------------------------------------------- presets

PRESETS: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec(compute="fp32", name="fp32"),
    "bf16": PrecisionSpec(_float("bf16"), _float("bf16"), _float("bf16"), compute="bf16", name="bf16"),
    "fp16": PrecisionSpec(_float("fp16"), _float("fp16"), _float("fp16"), compute="fp16", name="fp16"),
    "fp8": PrecisionSpec(weights=TensorSpec("fp8_e4m3", "per_tensor", "dynamic"),
                         activations=TensorSpec("fp8_e4m3", "per_tensor", "calibrated"),
                         kv=_float("bf16"), compute="bf16", name="fp8"),
    "int8": PrecisionSpec(weights=TensorSpec("int8", "per_channel", "dynamic"),
                          activations=TensorSpec("int8", "per_tensor", "calibrated"),
                          kv=_float("bf16"), compute="bf16", name="int8"),
}
