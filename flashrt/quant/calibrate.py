"""Calibration: collect amax at every GEMM input over N samples, reduce across samples, make scales.

Two phases (house style #7): calibrate offline into an artifact (the CalibrationCache entry), install
the scales at load. This module is the first phase.

- `collect_amax(model, samples)` registers forward pre-hooks on the GEMM modules (nn.Linear by
  default), runs every sample, and records per-sample amax of each module's input. A module called
  several times in one sample (a flow-matching expert over its denoise steps) keeps the max over its
  calls, so one scale set covers every step. Hooks are removed in `finally`.
- `reduce_amax(per_sample, method, percentile)` reduces the (N,) sample axis: "max", "mean" or
  "percentile" (linear interpolation, as numpy's default).
- `calibrate(model, samples, recipe, dtype)` = collect -> reduce -> compute_scale: name -> 0-dim scale.

A `Recipe` (calibration/*.toml) names the method, percentile, sample count, seed and data source;
`load_recipe()` refuses unknown keys and bad values with ConfigError.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashrt.errors import CalibrationError, ConfigError
from flashrt.io.digest import tensor_digest
from flashrt.io.files import read_toml
from flashrt.quant.ops import amax_per_tensor, compute_scale
from flashrt.quant.precision import DTypeInfo
from flashrt.resources import data_dir, list_data

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------- reductions

REDUCTIONS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "max": lambda a, p: a.amax(dim=0),
    "mean": lambda a, p: a.mean(dim=0),
    "percentile": lambda a, p: torch.quantile(a, p / 100.0, dim=0),
}


def reduce_amax(per_sample: torch.Tensor, method: str = "percentile",
                percentile: float = 99.9) -> torch.Tensor:
    """Reduce per-sample amax values (N, ...) over the sample axis with a named method."""
    if method not in REDUCTIONS:
        raise ConfigError(f"unknown calibration method {method!r}; known: {sorted(REDUCTIONS)}")
    if per_sample.shape[0] == 0:
        raise CalibrationError("no samples to reduce")
    return REDUCTIONS[method](per_sample.float(), percentile)


# ---------------------------------------------------------------------------------------------- recipes

_DATA_SOURCE = re.compile(r"^(synthetic|user|file:.+)$")


@dataclass(frozen=True)
class Recipe:
    """How to calibrate. `data`: "synthetic" (seeded random inputs at the static shapes, drawn by the
    frontend), "user" (samples passed by the caller, e.g. recorded observations) or "file:<path>"
    (frozen inputs in a safetensors file; see `data_file`)."""

    name: str = "default-amax"
    description: str = ""
    method: str = "percentile"
    percentile: float = 99.9
    samples: int = 8
    seed: int = 0
    data: str = "synthetic"
    # which GEMMs are quantized (quantized models: `flashrt.quant.flow`): nn.Linear names matching an
    # `include` glob and no `exclude` glob; everything else (norms, embeddings, convs) stays float
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    activations: str = "static"  # "static" (calibrated per-tensor scales) | "per_token" (dynamic)
    scale_factor: float = 1.0  # multiplies every calibrated activation amax (< 1 clips harder)
    holdout: int = 2  # held-out samples the quality gate runs after calibrating (0: no gate)
    min_cosine: float = 0.995  # quality gate: per-sample cosine of the outputs against float
    max_abs_delta: float = 0.05  # quality gate: max |quantized - float| output element
    max_layer_error: float = 0.2  # quality gate: relative output error of any one quantized GEMM

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", _globs(self, "include"))
        object.__setattr__(self, "exclude", _globs(self, "exclude"))
        _check_types(self)
        _check_quantization(self)
        if self.method not in REDUCTIONS:
            raise ConfigError(f"recipe {self.name!r}: unknown method {self.method!r}; "
                              f"known: {sorted(REDUCTIONS)}")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"recipe {self.name!r}: percentile must be in (0, 100], got {self.percentile}")
        if self.samples < 1:
            raise ConfigError(f"recipe {self.name!r}: samples must be >= 1, got {self.samples}")
        if not _DATA_SOURCE.match(self.data):
            raise ConfigError(f"recipe {self.name!r}: data must be 'synthetic', 'user' or 'file:<path>', "
                              f"got {self.data!r}")

    def data_file(self, base: str | os.PathLike | None = None) -> Path | None:
        """The safetensors file of a "file:" source (relative to `base`, default the shipped
        calibration/ folder); None for "synthetic" and "user"."""
        if not self.data.startswith("file:"):
            return None
        path = Path(self.data[len("file:"):])
        folder = Path(base) if base is not None else data_dir("calibration")
        return path if path.is_absolute() else folder / path

    def key_fields(self, data_digest: str) -> dict[str, Any]:
        """The recipe part of a calibration cache key, bound to the digest of the samples actually used."""
        return {"method": self.method, "percentile": float(self.percentile), "samples": self.samples,
                "seed": self.seed, "data": self.data, "data_digest": data_digest,
                "include": list(self.include), "exclude": list(self.exclude), "activations": self.activations,
                "scale_factor": float(self.scale_factor), "holdout": self.holdout,
                "min_cosine": float(self.min_cosine), "max_abs_delta": float(self.max_abs_delta),
                "max_layer_error": float(self.max_layer_error)}

    def quantizes(self, name: str) -> bool:
        """Whether the GEMM module ``name`` is quantized under this recipe (include and not exclude)."""
        return (any(fnmatch.fnmatchcase(name, g) for g in self.include)
                and not any(fnmatch.fnmatchcase(name, g) for g in self.exclude))


_FIELD_TYPES = {"name": (str,), "description": (str,), "method": (str,), "percentile": (int, float),
                "samples": (int,), "seed": (int,), "data": (str,), "activations": (str,),
                "scale_factor": (int, float), "holdout": (int,), "min_cosine": (int, float),
                "max_abs_delta": (int, float), "max_layer_error": (int, float)}
ACTIVATION_MODES = ("static", "per_token")


def _globs(recipe: Recipe, name: str) -> tuple[str, ...]:
    value = getattr(recipe, name)
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, str) for v in value):
        raise ConfigError(f"recipe {recipe.name!r}: {name} must be a list of glob strings, got {value!r}")
    return tuple(value)


def _check_quantization(recipe: Recipe) -> None:
    where = f"recipe {recipe.name!r}"
    if recipe.activations not in ACTIVATION_MODES:
        raise ConfigError(f"{where}: activations must be one of {list(ACTIVATION_MODES)}, "
                          f"got {recipe.activations!r}")
    if not recipe.scale_factor > 0 or recipe.holdout < 0:
        raise ConfigError(f"{where}: scale_factor must be > 0 and holdout >= 0")
    if not 0.0 < recipe.min_cosine <= 1.0 or not recipe.max_abs_delta > 0 or not recipe.max_layer_error > 0:
        raise ConfigError(f"{where}: min_cosine must be in (0, 1], max_abs_delta and max_layer_error > 0")


def _check_types(recipe: Recipe) -> None:
    for name, types in _FIELD_TYPES.items():
        value = getattr(recipe, name)
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"recipe {recipe.name!r}: {name} must be {wanted}, got {value!r}")


def recipe_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Recipe:
    """Build a Recipe, refusing unknown keys (ConfigError names them and the allowed ones)."""
    allowed = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{source}: unknown recipe keys {unknown}; allowed: {sorted(allowed)}")
    return Recipe(**data)


def load_recipe(name_or_path: str | os.PathLike) -> Recipe:
    """A shipped recipe by name (calibration/<name>.toml) or a recipe TOML file by path."""
    path = _recipe_path(name_or_path)
    data = read_toml(path, "calibration recipe", ConfigError)
    data.setdefault("name", path.stem)
    return recipe_from_dict(data, source=str(path))


def _recipe_path(name_or_path: str | os.PathLike) -> Path:
    shipped = list_data("calibration")
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    raise ConfigError(f"no calibration recipe {str(name_or_path)!r}; shipped: {sorted(shipped)}, "
                      "or pass a path to a .toml file")


# ------------------------------------------------------------------------------------------- collection


def samples_digest(samples: Iterable[Any]) -> str:
    """Digest of calibration samples (tensors, or dicts/lists/tuples of them) for the cache key."""
    flat: dict[str, torch.Tensor] = {}
    for i, sample in enumerate(samples):
        _flatten(sample, str(i), flat)
    return tensor_digest(flat)


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = torch.tensor(list(repr(obj).encode()), dtype=torch.uint8)


def default_run(model: nn.Module, sample: Any) -> Any:
    """Call the model on one sample: a dict as keywords, a tuple/list as positional args, else one arg."""
    if isinstance(sample, Mapping):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


class _AmaxRecorder:
    """Forward pre-hooks that keep, per module, the max input amax of the current sample."""

    def __init__(self) -> None:
        self.current: dict[str, torch.Tensor] = {}
        self.history: dict[str, list[torch.Tensor]] = {}

    def hook(self, name: str) -> Callable:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if x is None:
                return
            a = amax_per_tensor(x)
            prev = self.current.get(name)
            self.current[name] = a if prev is None else torch.maximum(prev, a)

        return pre_hook

    def end_sample(self) -> None:
        for name, a in self.current.items():
            self.history.setdefault(name, []).append(a)
        self.current = {}


def gemm_modules(model: nn.Module, module_types: tuple[type, ...] = (nn.Linear,)) -> dict[str, nn.Module]:
    """name -> module for every module of the given types (the GEMM sites that get an input scale)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, module_types)}


def collect_amax(model: nn.Module, samples: Iterable[Any], run: Callable[[nn.Module, Any], Any] = default_run,
                 module_types: tuple[type, ...] = (nn.Linear,)) -> dict[str, torch.Tensor]:
    """name -> (N,) float32 amax of each GEMM module's input, one value per sample it ran in (on CPU)."""
    sites = gemm_modules(model, module_types)
    if not sites:
        raise CalibrationError(f"{type(model).__name__} has no {[t.__name__ for t in module_types]} modules")
    if model.training:
        log.warning("calibrating %s in training mode (dropout and similar change amax); call .eval() first",
                    type(model).__name__)
    recorder = _AmaxRecorder()
    handles = [m.register_forward_pre_hook(recorder.hook(n), with_kwargs=True) for n, m in sites.items()]
    try:
        with torch.no_grad():
            for sample in samples:
                run(model, sample)
                recorder.end_sample()
    finally:
        for h in handles:
            h.remove()
    return _stack_history(recorder.history, sites)


def _stack_history(history: dict[str, list[torch.Tensor]], sites: Mapping[str, nn.Module]) -> dict:
    unused = sorted(set(sites) - set(history))
    if unused:
        log.warning("no calibration data for %d GEMM module(s) never called: %s", len(unused), unused)
    out = {name: torch.stack(values).cpu() for name, values in history.items()}
    bad = sorted(name for name, a in out.items() if not bool(torch.isfinite(a).all()))
    if bad:
        raise CalibrationError(f"non-finite GEMM inputs during calibration at {bad}: the model produced inf "
                               "or NaN on the calibration samples; check the samples and the weights")
    return out


def calibrate(model: nn.Module, samples: Iterable[Any], recipe: Recipe | None = None,
              dtype: str | DTypeInfo = "fp8_e4m3", run: Callable[[nn.Module, Any], Any] = default_run,
              module_types: tuple[type, ...] = (nn.Linear,)) -> dict[str, torch.Tensor]:
    """name -> 0-dim float32 input scale of every GEMM module, from `recipe.samples` samples.

    Takes the first `recipe.samples` items of `samples`; fewer is a CalibrationError (the cache key
    records the count, so it must be true).
    """
    recipe = recipe or Recipe()
    taken = list(islice(samples, recipe.samples))
    if len(taken) < recipe.samples:
        raise CalibrationError(f"recipe {recipe.name!r} needs {recipe.samples} samples, got {len(taken)}")
    per_sample = collect_amax(model, taken, run, module_types)
    return {name: compute_scale(reduce_amax(a, recipe.method, recipe.percentile), dtype)
            for name, a in per_sample.items()}
