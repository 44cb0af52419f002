"""The quality gate of the calibration flow (flashrt/quant/flow.py `gate`) judges by the worst held-out
sample: one bad sample among good ones fails it, whether its outputs or one layer show it; each bound
is inclusive (a figure exactly at its bound passes, the next float past it fails)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from flashrt.errors import CalibrationError
from flashrt.quant.cache import CalibrationCache
from flashrt.quant.calibrate import Recipe
from flashrt.quant.flow import QuantJob, gate, gemm_sites, observe, quantize_model

LOOSE = Recipe(name="gate-test", samples=4, holdout=6, method="max", min_cosine=1e-6, max_abs_delta=1e9,
               max_layer_error=1e9)
KEY = {"data_digest": "d", "config": {}, "shapes": {}, "arch": "cpu"}  # a cache key's caller fields


def _model() -> nn.Module:
    torch.manual_seed(0)  # no bias in the first GEMM: a quiet input's quantization error shows there
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8)).eval()


def _samples(scale_of_bad: float | None) -> tuple[list, list]:
    """(4 calibration samples, 6 held-out: 5 good and, if asked, one at ``scale_of_bad`` in the middle)."""
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(4, 16, generator=g) for _ in range(4)]
    held = [torch.randn(4, 16, generator=g) for _ in range(6)]
    if scale_of_bad is not None:
        held[3] = held[3] * scale_of_bad
    return calib, held


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = _model()
    calib, _ = _samples(None)
    job = QuantJob(kind="int8", recipe=LOOSE, run=model, samples=calib, key_fields={},
                   cache=CalibrationCache(tmp_path_factory.mktemp("cache")))
    sites = gemm_sites(model, LOOSE)
    with torch.no_grad():
        amax = observe(model, sites, calib, model, False, LOOSE)
    return model, sites, job, amax


def _gate(setup, held, **bounds):
    model, sites, job, amax = setup
    with torch.no_grad():
        return gate(model, sites, replace(job, recipe=replace(LOOSE, **bounds)), amax, held)


def test_a_single_loud_sample_fails_the_output_bounds_the_mean_would_pass(setup):
    _, held = _samples(20.0)  # clipped far past the calibrated range
    r = _gate(setup, held)
    cos, delta = r["cosine"], r["abs_delta"]
    assert min(cos) == cos[3] and max(delta) == delta[3]
    mean_cos, mean_delta = sum(cos) / len(cos), sum(delta) / len(delta)
    assert _gate(setup, held, min_cosine=(min(cos) + mean_cos) / 2)["passed"] is False
    assert _gate(setup, held, max_abs_delta=(max(delta) + mean_delta) / 2)["passed"] is False
    good = held[:3] + held[4:]
    assert _gate(setup, good, min_cosine=(min(cos) + mean_cos) / 2,
                 max_abs_delta=(max(delta) + mean_delta) / 2)["passed"] is True


def test_a_single_quiet_sample_fails_the_layer_bound_pooled_errors_would_pass(setup):
    """A quiet sample (inputs well inside one activation step) is quantized to almost nothing: its first
    GEMM is wrong by ~100% while its outputs (the second GEMM's bias) look fine, and its squared errors
    are too small to show in errors pooled over the held-out samples."""
    _, held = _samples(0.005)
    alone = [_gate(setup, [s])["layers"]["0"]["rel_error"] for s in held]
    worst = max(alone)
    assert worst == alone[3] and worst > 10 * max(alone[:3] + alone[4:])
    r = _gate(setup, held)
    assert r["max_layer_error"] == pytest.approx(worst, rel=1e-12) and r["worst_layer"] == "0"
    bound = math.sqrt(worst * max(alone[:3] + alone[4:]))  # between the good samples and the bad one
    assert _gate(setup, held, max_layer_error=bound)["passed"] is False
    assert _gate(setup, held[:3] + held[4:], max_layer_error=bound)["passed"] is True


@pytest.mark.parametrize("field, figure, past", [
    ("min_cosine", "min_cosine", -math.inf),        # passes at >= the bound: the next float up fails
    ("max_abs_delta", "max_abs_delta", math.inf),   # passes at <= the bound: the next float down fails
    ("max_layer_error", "max_layer_error", math.inf)])
def test_each_bound_is_inclusive_to_the_last_float(setup, field, figure, past):
    _, held = _samples(20.0)
    value = _gate(setup, held)[figure]
    assert _gate(setup, held)[figure] == value, "the gate's figures are deterministic"
    assert _gate(setup, held, **{field: value})["passed"] is True
    assert _gate(setup, held, **{field: math.nextafter(value, -past)})["passed"] is False


def test_quantize_model_refuses_and_caches_nothing_when_one_held_out_sample_is_bad(tmp_path):
    calib, held = _samples(0.005)
    model = _model()
    job = QuantJob(kind="int8", recipe=replace(LOOSE, max_layer_error=0.2), run=model,
                   samples=calib + held, key_fields=KEY,
                   cache=CalibrationCache(tmp_path / "cache"), progress=False, model_name="gate-test")
    with torch.no_grad(), pytest.raises(CalibrationError, match="worst layer '0'"):
        quantize_model(model, job)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    good = replace(job, samples=calib + held[:3] + held[4:] + held[:1])
    with torch.no_grad():
        assert quantize_model(_model(), good)["cache"] == "calibrated"
