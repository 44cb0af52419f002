"""The `--vs <reference package>` sides of every benchmark run once where their package imports (the
reference environment), agreeing with flashrt on the same inputs; elsewhere (CI) they skip with the
reason, and the refusal itself is tested in each adapter's own tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt.bench.adapters import pi0 as pi0_bench
from flashrt.bench.adapters import vocoders as vb
from flashrt.bench.profiles import parse_profile
from flashrt.profile.timers import StageTimer

BASE = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny"},
        "bench": {"warmup": 1, "iters": 2, "trace_len": 2, "target_rate_hz": 10.0},
        "quality": {"atol": 1e-4, "rtol": 1e-4}}


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not importable here (it lives in the reference environment)")


@pytest.mark.parametrize("variant", pi0_bench.VARIANTS)
def test_lerobot_side_agrees(variant, monkeypatch):
    _needs("lerobot")
    monkeypatch.chdir(Path(__file__).resolve().parents[3])        # the checkout the reference builds from
    bench = pi0_bench.Pi0Benchmark(variant, parse_profile(BASE, "ref"), None, "cpu")
    try:
        ref = bench.reference("lerobot")
        for x in bench.make_inputs(0):
            ours, theirs = bench.run(x, StageTimer()), ref.run(x, StageTimer())
            assert np.abs(ours["actions"] - theirs["actions"]).max() <= 1e-4
    finally:
        bench.close()


@pytest.mark.parametrize("name", tuple(vb.SPECS))
def test_vocoder_package_side_agrees(name):
    package = vb.SPECS[name].package
    _needs(package)
    bench = vb.FACTORIES[name](parse_profile(BASE, "ref"), None, "cpu")
    try:
        ref = bench.reference(package)
        for x in bench.make_inputs(0):
            ours, theirs = bench.run(x, StageTimer()), ref.run(x, StageTimer())
            assert torch.as_tensor(ours["audio"] - theirs["audio"]).abs().max() <= 1e-4
    finally:
        bench.close()
