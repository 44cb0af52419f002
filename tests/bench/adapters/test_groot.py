"""The `groot-n17` benchmark adapter on the tiny preset: registration, the quality gate through the
harness against the trace backend (bit-equal here), FLOP accounting, the control-loop policy, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt.bench.adapters import groot as groot_bench
from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import ReferenceUnavailable, available
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer


def profile(**model):
    data = {
        "device": {"kind": "cpu", "threads": 1},
        "shapes": {"preset": "tiny"},
        "bench": {"warmup": 1, "iters": 3, "trace_len": 2, "target_rate_hz": 10.0},
        "quality": {"atol": 1e-5, "rtol": 1e-5},
        "model": model,
    }
    return parse_profile(data, "groot-test")


def test_registered():
    assert "groot-n17" in available()


def test_gate_against_trace_and_accounting(one_thread):
    result = run_benchmark("groot-n17", profile(), BenchOptions(vs="trace", progress=False))
    assert result.status == "ok", result.reason
    bench = groot_bench.make_groot_benchmark(profile(variant="n16"))
    try:
        flops, nbytes = bench.flops_bytes()
        assert flops > 0 and nbytes > bench.memory()["weights"] > 0
        inputs = bench.make_inputs(0)
        out = bench.run(inputs[0], StageTimer("cpu", nvtx=False))["actions"]
        assert out.shape == (8, 7) and np.isfinite(out).all()
        assert bench.policy().step(inputs[0]["obs"]).shape == (7,)
        with pytest.raises(ReferenceUnavailable, match="groot_vs_lerobot"):
            bench.reference("lerobot")
    finally:
        bench.close()


def test_refusals():
    with pytest.raises(ConfigError, match="presets|preset"):
        groot_bench.make_groot_benchmark(parse_profile({"shapes": {"preset": "huge"}}, "p"))
    with pytest.raises(ConfigError, match="variant"):
        groot_bench.make_groot_benchmark(profile(variant="n15"))
    with pytest.raises(ConfigError, match="keys"):
        groot_bench.make_groot_benchmark(profile(colour="red"))


def test_int8_run_quantizes_before_capture_and_is_gated_against_fp32(one_thread, monkeypatch, tmp_path):
    from dataclasses import replace

    import flashrt.quant.cache
    from flashrt.quant import linear

    monkeypatch.setattr(flashrt.quant.cache, "default_root", lambda: tmp_path)  # not the user's cache
    result = run_benchmark("groot-n17", replace(profile(), precision="int8"),
                           BenchOptions(vs="fp32", progress=False))
    assert result.status == "ok", result.reason
    assert result.gate["vs"]["passed"] and result.gate["vs"]["atol"] == 0.5
    assert result.gate["quantization"]["cache"] == "calibrated"
    assert result.gate["quantization"]["min_cosine"] >= 0.995
    bench = groot_bench.make_groot_benchmark(replace(profile(), precision="int8"))
    try:
        assert bench.quantization["cache"] == "hit"  # the same random weights: the same entry
        assert any(isinstance(m.weight, linear.QuantWeight) for m in bench.model.modules()
                   if isinstance(m, torch.nn.Linear))
        assert bench.vs_tolerance("trace") == (0.5, 0.0) and bench.vs_tolerance("eager") is None
    finally:
        bench.close()
