import json
import math

import numpy as np
import pytest

from flashrt.profile.stats import LatencyStats, percentile

KNOWN = [12.5, 3.0, 7.25, 1.0, 99.0, 4.5, 4.5, 18.0, 2.0, 6.0, 11.0]


@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(q):
    rng = np.random.default_rng(int(q * 10))
    data = sorted(rng.lognormal(1.0, 0.7, size=257).tolist())
    assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)), rel=1e-12)


def test_stats_from_known_samples():
    s = LatencyStats.from_samples(KNOWN)
    arr = np.asarray(KNOWN)
    assert s.count == len(KNOWN) and s.failures == 0
    assert s.mean == pytest.approx(arr.mean())
    assert s.std == pytest.approx(arr.std())
    assert s.min == 1.0 and s.max == 99.0
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert getattr(s, name) == pytest.approx(np.percentile(arr, q))
    assert s.jitter == pytest.approx(np.percentile(arr, 99) / np.percentile(arr, 50))
    assert s.deadline_ms is None and s.deadline_misses is None


def test_deadline_misses_and_failures_count():
    s = LatencyStats.from_samples(KNOWN, rate_hz=100.0, failures=2)  # deadline 10 ms
    over = sum(x > 10.0 for x in KNOWN)
    assert s.deadline_ms == pytest.approx(10.0)
    assert s.deadline_misses == over + 2
    assert s.attempts == len(KNOWN) + 2
    assert s.miss_rate == pytest.approx((over + 2) / (len(KNOWN) + 2))


def test_single_sample_and_empty():
    one = LatencyStats.from_samples([5.0], rate_hz=50)
    assert one.p50 == one.p99 == one.max == 5.0 and one.jitter == 1.0 and one.std == 0.0
    empty = LatencyStats.from_samples([], rate_hz=50, failures=3)
    assert empty.count == 0 and math.isnan(empty.p50)
    assert empty.deadline_misses == 3 and empty.miss_rate == 1.0
    d = empty.to_dict()
    assert d["p50"] is None and d["jitter"] is None
    json.dumps(d, allow_nan=False)


def test_to_dict_keys_are_stable_and_json():
    d = LatencyStats.from_samples(KNOWN, rate_hz=30).to_dict()
    assert tuple(d) == LatencyStats.keys() == (
        "count", "failures", "mean", "std", "min", "p50", "p90", "p99", "max", "jitter",
        "rate_hz", "deadline_ms", "deadline_misses", "miss_rate")
    assert json.loads(json.dumps(d, allow_nan=False)) == d


@pytest.mark.parametrize("kwargs", [{"rate_hz": 0}, {"rate_hz": -5}, {"failures": -1}])
def test_bad_arguments_rejected(kwargs):
    with pytest.raises(ValueError):
        LatencyStats.from_samples([1.0], **kwargs)


def test_non_finite_sample_rejected():
    with pytest.raises(ValueError, match="finite"):
        LatencyStats.from_samples([1.0, float("nan")])


# A sample exactly at the deadline is on time (`>` not `>=`); one ulp over is a miss.
DEADLINE_BOUNDARY = {
    "exactly at 10 ms": ([10.0], 0),
    "one ulp over": ([math.nextafter(10.0, math.inf)], 1),
    "one ulp under": ([math.nextafter(10.0, 0.0)], 0),
    "mixed": ([10.0, 10.5, 9.5, 10.0], 1),
}


@pytest.mark.parametrize("case", DEADLINE_BOUNDARY)
def test_deadline_boundary(case):
    samples, misses = DEADLINE_BOUNDARY[case]
    s = LatencyStats.from_samples(samples, rate_hz=100.0)  # deadline exactly 10.0 ms
    assert s.deadline_ms == 10.0 and s.deadline_misses == misses
