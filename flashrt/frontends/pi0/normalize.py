"""State / action (un)normalization with a checkpoint's own statistics, in its own convention.

Two conventions, each reproduced operation for operation (float32), because they differ in where the
epsilon goes:

lerobot 0.6.1 (`lerobot/processor/normalize_processor.py`, eps from the step config, default 1e-8)::

    MEAN_STD    norm (x - mean) / (std + eps)              unnorm x * std + mean
    MIN_MAX     d = max - min (eps where d == 0)           norm 2 * (x - min) / d - 1
                                                           unnorm (x + 1) / 2 * d + min
    QUANTILES   d = q99 - q01 (eps where d == 0)           norm 2 * (x - q01) / d - 1
                                                           unnorm (x + 1) * d / 2 + q01
    QUANTILE10  as QUANTILES with q10 / q90
    IDENTITY    x

openpi (`openpi/transforms.py`, eps 1e-6 always added)::

    mean_std    norm (x - mean) / (std + eps)              unnorm x * (std + eps) + mean
    quantiles   norm (x - q01) / (q99 - q01 + eps) * 2 - 1  unnorm (x + 1) / 2 * (q99 - q01 + eps) + q01

Where the statistics live:

* lerobot policy dir: `policy_preprocessor.json` names a `normalizer_processor` step whose `state_file`
  (`policy_preprocessor_step_<i>_normalizer_processor.safetensors`) holds flat tensors
  `<feature>.<stat>` (e.g. `observation.state.q01`); its config gives `norm_map` (feature type ->
  mode), `features` (key -> type, shape) and `eps`. `policy_postprocessor.json` has the matching
  `unnormalizer_processor` step for the action.
* openpi dir: `assets/<asset_id>/norm_stats.json` = ``{"norm_stats": {"state": {...}, "actions": {...}}}``
  with mean/std/q01/q99 lists; Pi0 uses mean/std, Pi0.5 quantiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import CheckpointError
from flashrt.io.files import check_regular, read_json, resolve_inside

Fn = Callable[["Normalizer", torch.Tensor], torch.Tensor]


def _safe_denom(d: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.where(d == 0, torch.tensor(eps, dtype=d.dtype, device=d.device), d)


def _std_eps(n: Normalizer) -> torch.Tensor:
    return n.derived("std+eps", lambda: n.s("std") + n.eps)


def _span(n: Normalizer, lo: str, hi: str) -> torch.Tensor:
    return n.derived(f"{hi}-{lo}", lambda: _safe_denom(n.s(hi) - n.s(lo), n.eps))


def _lr_mean_std(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return (x - n.s("mean")) / _std_eps(n)


def _lr_mean_std_inv(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return x * n.s("std") + n.s("mean")


def _lr_range(lo: str, hi: str) -> tuple[Fn, Fn]:
    def norm(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * (x - n.s(lo)) / _span(n, lo, hi) - 1.0

    def unnorm(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
        return (x + 1.0) * _span(n, lo, hi) / 2.0 + n.s(lo)

    return norm, unnorm


def _lr_min_max_inv(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return (x + 1) / 2 * _span(n, "min", "max") + n.s("min")


def _op_mean_std(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return (x - n.s("mean")) / _std_eps(n)


def _op_mean_std_inv(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return x * _std_eps(n) + n.s("mean")


def _op_span(n: Normalizer) -> torch.Tensor:
    return n.derived("q99-q01+eps", lambda: n.s("q99") - n.s("q01") + n.eps)


def _op_quantiles(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return (x - n.s("q01")) / _op_span(n) * 2.0 - 1.0


def _op_quantiles_inv(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return (x + 1.0) / 2.0 * _op_span(n) + n.s("q01")


def _identity(n: Normalizer, x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Mode:
    """One normalization mode: the statistics it needs and its forward / inverse maps."""

    stats: tuple[str, ...]
    norm: Fn
    unnorm: Fn


_LR_QUANTILES, _LR_QUANTILE10 = _lr_range("q01", "q99"), _lr_range("q10", "q90")
MODES: dict[tuple[str, str], Mode] = {
    ("lerobot", "IDENTITY"): Mode((), _identity, _identity),
    ("lerobot", "MEAN_STD"): Mode(("mean", "std"), _lr_mean_std, _lr_mean_std_inv),
    ("lerobot", "MIN_MAX"): Mode(("min", "max"), _lr_range("min", "max")[0], _lr_min_max_inv),
    ("lerobot", "QUANTILES"): Mode(("q01", "q99"), *_LR_QUANTILES),
    ("lerobot", "QUANTILE10"): Mode(("q10", "q90"), *_LR_QUANTILE10),
    ("openpi", "IDENTITY"): Mode((), _identity, _identity),
    ("openpi", "MEAN_STD"): Mode(("mean", "std"), _op_mean_std, _op_mean_std_inv),
    ("openpi", "QUANTILES"): Mode(("q01", "q99"), _op_quantiles, _op_quantiles_inv),
}
DEFAULT_EPS = {"lerobot": 1e-8, "openpi": 1e-6}


@dataclass(frozen=True)
class Normalizer:
    """(Un)normalizes one feature (the state or the action) with its statistics.

    Owns float32 copies of the statistics on one device; `to(device)` returns a moved copy.
    """

    convention: str
    mode: str
    stats: Mapping[str, torch.Tensor] = field(default_factory=dict)
    eps: float = 1e-8
    name: str = ""
    _derived: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = (self.convention, self.mode)
        if key not in MODES:
            known = sorted(m for c, m in MODES if c == self.convention)
            raise CheckpointError(f"{self.name or 'feature'}: normalization mode {self.mode!r} is not "
                                  f"supported for {self.convention} checkpoints (supported: {known})")
        missing = [s for s in MODES[key].stats if s not in self.stats]
        if missing:
            raise CheckpointError(f"{self.name or 'feature'}: mode {self.mode} needs statistics {missing}, "
                                  f"the checkpoint has {sorted(self.stats)}")
        stats = {k: torch.as_tensor(v, dtype=torch.float32).reshape(-1) for k, v in self.stats.items()}
        object.__setattr__(self, "stats", stats)
        sizes = {k: v.numel() for k, v in stats.items() if k in MODES[key].stats}
        if len(set(sizes.values())) > 1:
            raise CheckpointError(f"{self.name or 'feature'}: statistics of different sizes {sizes}")
        bad = [k for k in MODES[key].stats if not bool(torch.isfinite(stats[k]).all())]
        if bad:
            raise CheckpointError(f"{self.name or 'feature'}: statistics {bad} hold NaN or inf; the "
                                  "checkpoint's normalization is broken (it would give wrong actions)")
        if not (isinstance(self.eps, float) and 0 <= self.eps < 1):
            raise CheckpointError(f"{self.name or 'feature'}: eps must be a float in [0, 1), "
                                  f"got {self.eps!r}")

    @property
    def dim(self) -> int | None:
        """Size of the feature the statistics describe (None for IDENTITY without statistics)."""
        needed = MODES[(self.convention, self.mode)].stats
        return self.stats[needed[0]].numel() if needed else None

    def s(self, name: str) -> torch.Tensor:
        return self.stats[name]

    def derived(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor of the statistics alone (a denominator such as ``std + eps``), made on first use and
        kept: a call then runs only the ops on its input, the same ops as before (bit for bit)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return MODES[(self.convention, self.mode)].norm(self, x)

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return MODES[(self.convention, self.mode)].unnorm(self, x)

    def to(self, device: str | torch.device) -> Normalizer:
        moved = {k: v.to(device) for k, v in self.stats.items()}
        return Normalizer(self.convention, self.mode, moved, self.eps, self.name)


# ------------------------------------------------------------------------------ lerobot processor files
def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, "processor/statistics file")


def find_step(pipeline: Mapping[str, Any], registry_name: str, source: Path) -> dict[str, Any]:
    """The step entry named `registry_name` in a lerobot pipeline JSON (CheckpointError if absent)."""
    steps = pipeline.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise CheckpointError(f"{source}: 'steps' must be a list of objects")
    for step in steps:
        if step.get("registry_name") == registry_name:
            return step
    names = [s.get("registry_name") for s in steps]
    raise CheckpointError(f"{source} has no {registry_name!r} step (steps: {names})")


def _load_step_state(policy_dir: Path, step: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = step.get("state_file")
    if not name:
        return {}
    path = resolve_inside(policy_dir, name, f"processor step {step.get('registry_name')!r} state_file")
    check_regular(path, "normalization statistics (named by the processor JSON)")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"cannot read normalization statistics {path}: {exc}") from None


def _feature_stats(state: Mapping[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    prefix = key + "."
    picked = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return {k: v for k, v in picked.items() if "." not in k}


def lerobot_normalizer(policy_dir: Path, pipeline_file: str, registry_name: str, key: str) -> Normalizer:
    """The Normalizer of feature `key` from a lerobot pipeline's (un)normalizer step."""
    source = policy_dir / pipeline_file
    step = find_step(_read_json(source), registry_name, source)
    config = _field(step, "config", dict, source, {})
    features = _field(config, "features", dict, source, {})
    if key not in features:
        raise CheckpointError(f"{source}: the {registry_name} step has no feature {key!r} "
                              f"(features: {sorted(features)})")
    kind = _field(_field(features, key, dict, source), "type", str, source)
    mode = _field(config, "norm_map", dict, source, {}).get(kind, "IDENTITY")
    stats = _feature_stats(_load_step_state(policy_dir, step), key)
    if not stats:
        mode = "IDENTITY"  # lerobot leaves a feature without statistics untouched
    eps = _field(config, "eps", (int, float), source, DEFAULT_EPS["lerobot"])
    return Normalizer("lerobot", str(mode), stats, float(eps), name=key)


def _field(table: Mapping[str, Any], name: str, kind: type | tuple[type, ...], source: Path,
           default: Any = ...) -> Any:
    """table[name] of type `kind` (bools are not numbers); CheckpointError naming file and field."""
    if name not in table:
        if default is ...:
            raise CheckpointError(f"{source}: field {name!r} is missing")
        return default
    value = table[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CheckpointError(f"{source}: field {name!r} has the wrong type ({type(value).__name__})")
    return value


# ------------------------------------------------------------------------------ openpi norm_stats.json
def openpi_normalizers(path: Path, quantiles: bool) -> tuple[Normalizer, Normalizer]:
    """(state, action) Normalizers from an openpi `norm_stats.json`."""
    data = _read_json(path)
    table = data.get("norm_stats", data)
    mode = "QUANTILES" if quantiles else "MEAN_STD"
    out = []
    for key in ("state", "actions"):
        if key not in table:
            raise CheckpointError(f"{path} has no {key!r} statistics (keys: {sorted(table)})")
        if not isinstance(table[key], dict):
            raise CheckpointError(f"{path}: {key!r} statistics must be an object of lists")
        try:
            stats = {k: torch.tensor(v, dtype=torch.float32) for k, v in table[key].items() if v is not None}
        except (TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: {key!r} statistics are not lists of numbers ({exc})") from None
        out.append(Normalizer("openpi", mode, stats, DEFAULT_EPS["openpi"], name=key))
    return out[0], out[1]
