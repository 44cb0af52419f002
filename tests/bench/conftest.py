import pytest

from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import unregister_benchmark


@pytest.fixture
def tiny_profile():
    """A CPU profile with few iterations, built in memory (no file)."""

    def make(**sections):
        data = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny"},
                "bench": {"warmup": 2, "iters": 12, "trace_len": 3, "target_rate_hz": 100.0},
                "quality": {"atol": 1e-6, "rtol": 1e-6}}
        for key, value in sections.items():
            data[key] = {**data.get(key, {}), **value}
        return parse_profile(data, "test-profile")

    return make


@pytest.fixture
def fake_name():
    name = "fake-test"
    yield name
    unregister_benchmark(name)
