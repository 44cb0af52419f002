"""The `pi0_fast` benchmark adapter on the parity fixture: registration, a run through the harness with
the eager gate, the trace backend as a reference, refusals; the lerobot side where lerobot imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from flashrt.bench.adapters import pi0_fast as fast_bench
from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import ReferenceUnavailable, available
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer

CHECKOUT = Path(__file__).resolve().parents[3]


def profile(**sections):
    data = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny"},
            "bench": {"warmup": 1, "iters": 3, "trace_len": 3, "target_rate_hz": 10.0},
            "quality": {"atol": 1e-5, "rtol": 1e-5}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_profile(data, "pi0-fast-test")


@pytest.fixture
def checkout(monkeypatch):
    monkeypatch.chdir(CHECKOUT)  # the default checkpoint is the checkout's parity fixture


def test_registered():
    assert available()["pi0_fast"].factory is fast_bench.make_pi0_fast_benchmark


def test_harness_gate_and_trace_reference(checkout):
    result = run_benchmark("pi0_fast", profile(), BenchOptions(vs="trace", progress=False))
    assert result.status == "ok" and result.implementation == "flashrt:eager"
    assert result.gate["passed"] and result.gate["max_abs"] == 0.0 and result.gate["vs"]["passed"]
    assert list(result.steady["stages"]) == ["validate", "h2d", "replay", "postprocess"]
    assert result.vs["pairs"] == 3


def test_refusals(checkout):
    with pytest.raises(ConfigError, match="model"):
        fast_bench.make_pi0_fast_benchmark(profile(model={"seed": 1}), None, "cpu")
    bench = fast_bench.make_pi0_fast_benchmark(profile(), None, "cpu")
    with pytest.raises(ReferenceUnavailable, match="compile"):
        bench.reference("compile")
    flops, nbytes = bench.flops_bytes()
    assert flops > 0 and nbytes > 0


def test_lerobot_side_agrees(checkout):
    if importlib.util.find_spec("lerobot") is None:
        pytest.skip("lerobot is not importable here (it lives in the reference environment)")
    bench = fast_bench.make_pi0_fast_benchmark(profile(), None, "cpu")
    ref = bench.reference("lerobot")
    for x in bench.make_inputs(0):
        ours, theirs = bench.run(x, StageTimer()), ref.run(x, StageTimer())
        np.testing.assert_allclose(ours["actions"], theirs["actions"], atol=1e-4, rtol=0)
