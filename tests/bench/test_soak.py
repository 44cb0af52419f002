import pytest

from flashrt.bench.soak import SoakConfig, run_soak, run_soak_benchmark, slope_per_step, summarize_soak

from .fakes import register_fake

CONFIG = SoakConfig(steps=600, warmup=50, sample_every=10)


def test_slope():
    assert slope_per_step([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope_per_step([1], [5]) == 0.0 and slope_per_step([2, 2], [1, 5]) == 0.0


def test_leaking_step_is_flagged():
    hoard = []
    summary = run_soak(lambda i: hoard.append(b"\x01" * 65536), CONFIG)
    assert summary["leak"] and summary["rss"]["leak"]
    assert summary["rss"]["growth_mib"] > 20 and summary["rss"]["mib_per_1k_steps"] > 30


def test_clean_step_is_not_flagged():
    buf = bytearray(65536)
    summary = run_soak(lambda i: buf.__setitem__(0, i % 256), CONFIG)
    assert not summary["leak"] and summary["failures"] == 0 and summary["latency"].count == 600


def test_failures_counted():
    def step(i):
        if i % 100 == 7:
            raise RuntimeError("x")

    summary = run_soak(step, CONFIG)
    assert summary["failures"] == 6 and summary["latency"].failures == 6 and summary["latency"].count == 594


def test_drift_from_first_and_last_decile():
    lat = [1.0] * 50 + [1.5] * 400 + [3.0] * 50
    samples = {"step": [], "rss": [], "cuda": [], "median_ms": []}
    s = summarize_soak(lat, 0, samples, SoakConfig(steps=500, warmup=10))
    assert s["drift"]["ratio"] == pytest.approx(3.0) and s["drift"]["flagged"]
    assert not summarize_soak([1.0] * 100, 0, samples, SoakConfig(steps=100))["drift"]["flagged"]


def test_soak_benchmark_flags_a_leaking_frontend(tiny_profile, fake_name):
    register_fake(fake_name, leak_bytes=131072)
    record = run_soak_benchmark(fake_name, tiny_profile(), SoakConfig(steps=400, warmup=20), progress=False)
    assert record["status"] == "leak" and record["soak"]["leak"] and record["kind"] == "soak"
    register_fake(fake_name)
    clean = run_soak_benchmark(fake_name, tiny_profile(), SoakConfig(steps=400, warmup=20), progress=False)
    assert clean["status"] == "ok"


def test_bad_config():
    with pytest.raises(ValueError):
        SoakConfig(steps=10)
    with pytest.raises(ValueError):
        SoakConfig(steps=100, warmup=100)
