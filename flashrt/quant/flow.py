"""The calibration flow as a loader runs it: cache hit -> install, miss -> calibrate, gate, store, install.

    info = quantize_model(model, QuantJob(kind="int8", recipe=recipe, run=run, samples=samples,
                                          key_fields={...}, cache=CalibrationCache(...)))

* **Which GEMMs**: every ``nn.Linear`` whose name the recipe quantizes (`Recipe.quantizes`); the
  recipe TOML (calibration/<family>.toml) decides, not code.
* **Cache hit**: the stored activation amax of every site is installed; no calibration pass runs
  (`COUNTERS["calibrations"]` does not move; `COUNTERS["hits"]` does).
* **Miss**: the first ``recipe.samples`` samples run with observing weights (`ObservedWeight`), the
  per-sample max |x| of each site is reduced with the recipe's method and multiplied by its
  ``scale_factor``. Then the **quality gate**: the next ``recipe.holdout`` samples run in float and
  quantized (with a per-site audit); each sample's outputs must have cosine >= ``min_cosine`` and
  max |Δ| <= ``max_abs_delta``, and every site's relative output error against the float GEMM on
  the same input must be <= ``max_layer_error`` (an output that hardly depends on a broken layer
  would hide it), else `CalibrationError` naming the worst site. The per-site report (amax, clipped
  fraction, relative error) is written next to the cache entry (``<entry>.report.json``) either way;
  only a passing calibration is stored (atomically). A stale, corrupt or tampered entry is a miss
  (`CalibrationCache.lookup`): it is recalibrated with a warning, never used.
* Finally the GEMM kernel of every shape is measured on one sample (`linear.tuning`).

Samples are whatever ``run`` takes (a frontend's observations); their digest is part of the key.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from flashrt.errors import CalibrationError, ConfigError
from flashrt.io.atomic import atomic_write_bytes
from flashrt.quant import linear
from flashrt.quant.cache import REPORT_SUFFIX, CacheKey, CalibrationCache
from flashrt.quant.calibrate import Recipe, load_recipe, reduce_amax, samples_digest

log = logging.getLogger(__name__)

COUNTERS: Counter = Counter()  # "calibrations" (passes run), "hits" (entries installed), "recalibrated"
KINDS = ("int8", "fp8")


@dataclass(frozen=True)
class Calibration:
    """What a caller passes as ``calibration=`` (or a recipe name / path, or a dict of these fields).

    recipe     a shipped recipe name or a TOML path ("" = the family's default)
    samples    overrides the recipe's calibration sample count
    data       recorded samples (e.g. observations of a `flashrt bench --save-trace` trace) instead of
               the family's synthetic generator; the first ``samples`` calibrate, the next ``holdout``
               gate
    cache_dir  the calibration cache folder (default: the user cache folder)
    progress   show a progress bar while calibrating
    """

    recipe: str | os.PathLike = ""
    samples: int | None = None
    data: Sequence[Any] | None = None
    cache_dir: str | os.PathLike | None = None
    progress: bool = True

    def load_recipe(self, default: str) -> Recipe:
        recipe = load_recipe(self.recipe or default)
        if self.samples is None:
            return recipe
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(f"calibration samples must be a positive int, got {self.samples!r}")
        from dataclasses import replace

        return replace(recipe, samples=self.samples)


def as_calibration(value: Any) -> Calibration:
    """None, a recipe name or path, a dict of `Calibration` fields, or a `Calibration`."""
    if value is None:
        return Calibration()
    if isinstance(value, Calibration):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Calibration(recipe=value)
    if isinstance(value, Mapping):
        allowed = set(Calibration.__dataclass_fields__)
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ConfigError(f"unknown calibration options {unknown}; allowed: {sorted(allowed)}")
        return Calibration(**value)
    raise ConfigError(f"calibration must be a recipe name, a path, a dict or a Calibration, got {value!r}")


@dataclass
class QuantJob:
    """One model to quantize: ``run(sample)`` runs it eagerly and returns its output tensor."""

    kind: str
    recipe: Recipe
    run: Callable[[Any], torch.Tensor]
    samples: Sequence[Any]
    key_fields: Mapping[str, Any]
    cache: CalibrationCache = field(default_factory=CalibrationCache)
    progress: bool = True
    model_name: str = ""
    device: str = "cpu"
    # called with the model once its quantized weights are installed, before the kernels are measured:
    # a family's kernel choices that depend on the weights' kinds (Pi0: one quantized gate|up GEMM)
    on_install: Callable[[nn.Module], None] | None = None


def gemm_sites(model: nn.Module, recipe: Recipe) -> dict[str, nn.Linear]:
    """name -> nn.Linear of every GEMM the recipe quantizes; ConfigError when it names none."""
    sites = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and recipe.quantizes(n)}
    if not sites:
        raise ConfigError(f"recipe {recipe.name!r} quantizes no nn.Linear of {type(model).__name__} "
                          f"(include {list(recipe.include)}, exclude {list(recipe.exclude)})")
    return sites


def make_key(job: QuantJob, mode: str) -> CacheKey:
    """The whole key: the caller's fields, the recipe with the samples' digest, the scheme."""
    digest = samples_digest(_tensors(job.samples[: job.recipe.samples + job.recipe.holdout]))
    precision = {"kind": job.kind, "activations": mode, "activation_qmax": _qmax(job, mode)}
    return CacheKey.create(recipe=job.recipe.key_fields(digest), precision=precision,
                           model=job.model_name, **job.key_fields)


def _qmax(job: QuantJob, mode: str) -> float:
    return linear.activation_qmax(job.device) if job.kind == "int8" else linear.FP8_MAX


def _tensors(obj: Any) -> Any:
    """Samples with numpy arrays as tensors (their bytes, not their repr, go into the digest)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, Mapping):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tensors(v) for v in obj]
    return obj


def quantize_model(model: nn.Module, job: QuantJob) -> dict[str, Any]:
    """Install the job's quantized weights in ``model`` (module docstring); returns what happened."""
    if job.kind not in KINDS:
        raise ConfigError(f"unknown quantized precision {job.kind!r}; use one of {list(KINDS)}")
    recipe, mode = job.recipe, job.recipe.activations
    if job.kind == "fp8" and mode != "static":
        raise ConfigError(f"recipe {recipe.name!r}: fp8 needs static activation scales, not {mode!r}")
    need = recipe.samples + recipe.holdout
    if len(job.samples) < need:
        raise CalibrationError(f"recipe {recipe.name!r} needs {need} samples ({recipe.samples} to calibrate "
                               f"+ {recipe.holdout} held out), got {len(job.samples)}")
    sites = gemm_sites(model, recipe)
    key = make_key(job, mode)
    found = job.cache.lookup(key)
    start = time.perf_counter()
    if found.scales is not None:
        COUNTERS["hits"] += 1
        amax, status = found.scales, "hit"
    else:
        if found.reason != "no entry":
            COUNTERS["recalibrated"] += 1
            log.warning("calibration entry %s not used (%s): recalibrating", found.path.name, found.reason)
        amax = _calibrate_and_gate(model, sites, job, found.path)
        status = "calibrated"
    _install(model, sites, job, amax, mode)
    if job.on_install is not None:
        job.on_install(model)
    with linear.tuning():
        job.run(job.samples[0])
    return {"cache": status, "entry": str(found.path), "seconds": round(time.perf_counter() - start, 3),
            "sites": len(sites), "kind": job.kind, "activations": mode, "recipe": recipe.name,
            "report": str(report_path(found.path))}


def quantize_family(model: nn.Module, kind: str, calibration: Any, *, default_recipe: str,
                    synthetic: Callable[[int, int], Sequence[Any]], run: Callable[[Any], torch.Tensor],
                    key_fields: Mapping[str, Any], name: str, device: torch.device,
                    checkpoint: str | os.PathLike | None = None, weights_digest: str | None = None,
                    on_install: Callable[[nn.Module], None] | None = None) -> dict[str, Any]:
    """What every family's quantized load does around `quantize_model`: the recipe and samples of a
    ``calibration=`` value (its recorded data, else ``synthetic(count, seed)`` over the recipe's count
    and seed), the cache, the key (the family's ``key_fields`` plus the weights' digest: the
    ``checkpoint`` folder's, or ``weights_digest`` for weights with no file) and the job."""
    cal = as_calibration(calibration)
    recipe = cal.load_recipe(default_recipe)
    need = recipe.samples + recipe.holdout
    samples = list(cal.data)[:need] if cal.data is not None else list(synthetic(need, recipe.seed))
    cache = CalibrationCache(cal.cache_dir)
    digest = weights_digest if weights_digest is not None else cache.data_digest(checkpoint)
    job = QuantJob(kind, recipe, run, samples, {"data_digest": digest, **key_fields}, cache, cal.progress,
                   name, device.type, on_install=on_install)
    return quantize_model(model, job)


def vs_bound(info: Mapping[str, Any] | None, name: str, own_backend: str, recipe: str | None,
             float_names: Sequence[str]) -> tuple[float, float] | None:
    """The gate of a quantized run against ``name`` (a bench `--vs` or quality reference): the recipe's
    max |delta| against a float precision in ``float_names`` or another backend of the same quantized
    model (a value on a rounding tie moves one quantization step under another runtime's float
    rounding); None (the profile's tolerance) for a float run or its own backend."""
    if info is None or (name not in float_names and name == own_backend):
        return None
    return float(load_recipe(recipe or info["recipe"]).max_abs_delta), 0.0


def gate_figures(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The quality gate's figures of a quantized load (``quantize_model``'s info), read from the report
    next to its cache entry: cache status, min cosine, max |delta|, max layer error, worst layer."""
    if info is None:
        return None
    import json

    try:
        report = json.loads(Path(info["report"]).read_text())
    except (OSError, ValueError, KeyError):
        return {"cache": info.get("cache")}
    return {"cache": info.get("cache"), **{k: report.get(k) for k in ("min_cosine", "max_abs_delta",
                                                                      "max_layer_error", "worst_layer")}}


def report_path(entry: Path) -> Path:
    """The per-layer quality-gate report beside a cache entry (removed with it by `flashrt cache rm`)."""
    return entry.with_name(entry.stem + REPORT_SUFFIX)


def _calibrate_and_gate(model: nn.Module, sites: dict, job: QuantJob, entry: Path) -> dict[str, torch.Tensor]:
    recipe = job.recipe
    amax = observe(model, sites, job.samples[: recipe.samples], job.run, job.progress, recipe)
    held = job.samples[recipe.samples: recipe.samples + recipe.holdout]
    if held:
        report = gate(model, sites, job, amax, held)
        _write_report(report_path(entry), report)
        if not report["passed"]:
            raise CalibrationError(_refusal(recipe, report, report_path(entry)))
    path = _store(job, entry, amax)
    msg = f"calibrated {len(sites)} GEMMs on {recipe.samples} samples ({recipe.name}); stored {path}"
    log.info(msg)
    if job.progress:
        tqdm.write(msg)
    return amax


def _store(job: QuantJob, entry: Path, amax: dict[str, torch.Tensor]) -> Path:
    key = make_key(job, job.recipe.activations)
    try:
        return job.cache.store(key, amax)
    except OSError as err:  # a read-only cache folder must not stop the model from running
        log.warning("could not store calibration entry in %s: %s", job.cache.root, err)
        return entry


def observe(model: nn.Module, sites: dict[str, nn.Linear], samples: Sequence[Any],
            run: Callable[[Any], Any], progress: bool, recipe: Recipe) -> dict[str, torch.Tensor]:
    """site -> () float32 activation amax: per-sample max |x| reduced by the recipe, times its factor."""
    COUNTERS["calibrations"] += 1
    current: dict[str, torch.Tensor] = {}
    history: dict[str, list[torch.Tensor]] = {n: [] for n in sites}

    def record(site: str, x: torch.Tensor) -> None:
        a = x.detach().abs().amax().float().cpu()
        current[site] = a if site not in current else torch.maximum(current[site], a)

    observed = {n: linear.ObservedWeight(m.weight, n, record) for n, m in sites.items()}
    old = linear.install(model, observed)
    try:
        for sample in tqdm(samples, desc=f"calibrating ({recipe.name})", disable=not progress, leave=False):
            run(sample)
            for n in sites:
                history[n].append(current.pop(n, torch.tensor(0.0)))
    finally:
        linear.install(model, old)
    out = {n: reduce_amax(torch.stack(h), recipe.method, recipe.percentile) * recipe.scale_factor
           for n, h in history.items()}
    bad = sorted(n for n, a in out.items() if not bool(torch.isfinite(a)))
    if bad:
        raise CalibrationError(f"non-finite GEMM inputs while calibrating at {bad}")
    return {n: a.clamp(min=1e-12).reshape(()) for n, a in out.items()}  # a zero input: any scale works


def _install(model: nn.Module, sites: dict, job: QuantJob, amax: Mapping[str, torch.Tensor], mode: str,
             audit: bool = False) -> dict[str, torch.Tensor]:
    missing = sorted(set(sites) - set(amax))
    if missing and mode == "static":
        raise CalibrationError(f"calibration entry has no scale for {missing}")
    weights = {}
    for name, m in sites.items():
        a = amax.get(name) if mode == "static" else None
        w = linear.quantize_weight(m.weight, job.kind, None if a is None else a.to(m.weight.device),
                                   mode=mode, site=name)
        if audit:
            w.audit, w.reference = linear.SiteStats(), m.weight.detach()
        weights[name] = w
    return linear.install(model, weights)


def gate(model: nn.Module, sites: dict, job: QuantJob, amax: Mapping[str, torch.Tensor],
         held: Sequence[Any]) -> dict[str, Any]:
    """Run ``held`` in float and quantized; per-sample cosine / max |Δ| and the per-site audit."""
    recipe = job.recipe
    reference = [job.run(s).double().flatten() for s in held]
    old = _install(model, sites, job, amax, recipe.activations, audit=True)
    try:
        stats = {n: model.get_submodule(n).weight.audit for n in sites}
        outputs = []
        for s in held:  # each sample judged alone: the worst one decides (linear.SiteStats)
            outputs.append(job.run(s).double().flatten())
            for st in stats.values():
                st.end_sample()
    finally:
        linear.install(model, old)
    cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(outputs, reference)]
    delta = [float((a - b).abs().max()) for a, b in zip(outputs, reference)]
    layers = {n: {**s.to_dict(), "amax_calibrated": float(amax[n]) if n in amax else None}
              for n, s in stats.items()}
    worst = max(layers, key=lambda n: layers[n]["rel_error"])
    worst_error = layers[worst]["rel_error"]
    passed = (min(cos) >= recipe.min_cosine and max(delta) <= recipe.max_abs_delta
              and worst_error <= recipe.max_layer_error)
    return {"passed": passed, "kind": job.kind, "recipe": recipe.name, "min_cosine": min(cos),
            "max_abs_delta": max(delta), "max_layer_error": worst_error,
            "bounds": {"min_cosine": recipe.min_cosine, "max_abs_delta": recipe.max_abs_delta,
                       "max_layer_error": recipe.max_layer_error},
            "cosine": cos, "abs_delta": delta, "worst_layer": worst, "layers": layers}


def _refusal(recipe: Recipe, report: Mapping[str, Any], path: Path) -> str:
    worst = report["layers"][report["worst_layer"]]
    return (f"quantized outputs fail the quality gate of recipe {recipe.name!r}: min cosine "
            f"{report['min_cosine']:.5f} (needs >= {recipe.min_cosine}), max |delta| "
            f"{report['max_abs_delta']:.4g} (needs <= {recipe.max_abs_delta}); worst layer "
            f"{report['worst_layer']!r} (relative error {worst['rel_error']:.3g}, needs <= "
            f"{recipe.max_layer_error}; {worst['clipped']:.1%} of inputs clipped); per-layer report: {path}. "
            "Nothing was cached: use more or other calibration "
            "samples, exclude that layer in the recipe, or load in float")


def _write_report(path: Path, report: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(report, indent=1).encode())
    except OSError as err:
        log.warning("could not write the calibration report %s: %s", path, err)
