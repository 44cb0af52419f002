"""The `groot-n16` / `groot-n15` benchmark adapters on the tiny presets: registration, the quality gate
through the harness against the trace backend, FLOP accounting, the control-loop policy, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from flashrt.bench.adapters import groot_eagle
from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import ReferenceUnavailable, available
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer

MAKERS = {"n16": groot_eagle.make_groot_n16_benchmark, "n15": groot_eagle.make_groot_n15_benchmark}


def profile(preset: str = "tiny", **model):
    data = {
        "device": {"kind": "cpu", "threads": 1},
        "shapes": {"preset": preset},
        "bench": {"warmup": 1, "iters": 3, "trace_len": 2, "target_rate_hz": 10.0},
        "quality": {"atol": 1e-5, "rtol": 1e-5},
        "model": model,
    }
    return parse_profile(data, "groot-test")


def test_registered():
    assert {"groot-n16", "groot-n15"} <= set(available())


@pytest.mark.parametrize("version", sorted(MAKERS))
def test_gate_against_trace_and_accounting(version, one_thread):
    result = run_benchmark(f"groot-{version}", profile(), BenchOptions(vs="eager", progress=False))
    assert result.status == "ok", result.reason
    bench = MAKERS[version](profile())
    try:
        assert bench.frontend.describe()["version"] == {"n16": "n1.6", "n15": "n1.5"}[version]
        flops, nbytes = bench.flops_bytes()
        assert flops > 0 and nbytes > bench.memory()["weights"] > 0
        inputs = bench.make_inputs(0)
        out = bench.run(inputs[0], StageTimer("cpu", nvtx=False))["actions"]
        assert out.shape == (8, 7) and np.isfinite(out).all()
        trace = bench.reference("trace").run(inputs[0], StageTimer("cpu", nvtx=False))["actions"]
        assert np.array_equal(out, trace)
        assert bench.policy().step(inputs[0]["obs"]).shape == (7,)
        with pytest.raises(ReferenceUnavailable, match="tests/frontends/groot"):
            bench.reference("lerobot")
    finally:
        bench.close()


@pytest.mark.parametrize("version", sorted(MAKERS))
def test_refusals(version):
    with pytest.raises(ConfigError, match="preset"):
        MAKERS[version](profile("huge"))
    with pytest.raises(ConfigError, match="keys"):
        MAKERS[version](profile(variant="n17"))
    with pytest.raises(ConfigError, match="random weights"):
        MAKERS[version](profile(), checkpoint="/some/folder")
