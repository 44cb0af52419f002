import gc
import mmap

import pytest
from support.bench_fakes import register_fake

from flashrt.bench.soak import MIB, SoakConfig, run_soak, run_soak_benchmark, slope_per_step, summarize_soak

CONFIG = SoakConfig(steps=600, warmup=50, sample_every=10)


def test_slope():
    assert slope_per_step([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope_per_step([1], [5]) == 0.0 and slope_per_step([2, 2], [1, 5]) == 0.0


def test_leaking_step_is_flagged():
    """Real RSS, decided from memory only: each step keeps 256 KiB of written pages in its own anonymous
    mapping (so no heap memory freed by earlier tests can absorb it, and no zero page hides it); other
    garbage is collected first and the collector is off during the run, so load can only slow it down."""
    hoard = []
    gc.collect()
    gc.disable()

    def leak(i: int) -> None:  # fresh anonymous pages, written: never reused from a freed heap
        block = mmap.mmap(-1, 256 << 10)
        block.write(b"\x01" * (256 << 10))
        hoard.append(block)

    try:
        summary = run_soak(leak, SoakConfig(steps=200, warmup=20, sample_every=5))
    finally:
        gc.enable()
    assert summary["leak"] and summary["rss"]["leak"]  # 45 MiB kept; the flag needs > 8 MiB and > 1 MiB/1k
    assert summary["rss"]["growth_mib"] > 30 and summary["rss"]["mib_per_1k_steps"] > 150


class FakeRss:
    """RSS readings from a script: `base + per_step * calls` bytes, plus a fixed jitter pattern."""

    def __init__(self, per_step_mib, jitter_mib=(0.0,)):
        self.calls, self.per_step, self.jitter = 0, per_step_mib, jitter_mib

    def __call__(self):
        value = (100 + self.per_step * self.calls + self.jitter[self.calls % len(self.jitter)]) * MIB
        self.calls += 1
        return int(value)


# The verdict from memory samples alone (steps=220, warmup=20, a sample every 10 steps: 20 samples over
# 190 steps). Leak = slope > 1 MiB per 1000 steps AND total growth > 8 MiB.
LEAK_VERDICTS = {
    "flat": (0.0, (0.0,), False),
    "allocator noise": (0.0, (0.0, 6.0, -2.0, 4.0), False),
    "steady growth": (0.5, (0.0,), True),                      # 9.5 MiB, 50 MiB/1k
    "slow but large": (0.4, (0.0,), False),                     # 7.6 MiB: under min_growth
    "one spike mid-run": (0.0, (0.0,) * 10 + (40.0,) + (0.0,) * 9, False),  # back down: no growth
    "a step up that stays": (0.0, (0.0,) * 10 + (12.0,) * 10, True),       # 12 MiB kept
}


@pytest.mark.parametrize("case", LEAK_VERDICTS)
def test_leak_verdict_depends_on_memory_only(case):
    per_sample, jitter, leak = LEAK_VERDICTS[case]
    summary = run_soak(lambda i: None, SoakConfig(steps=220, warmup=20, sample_every=10),
                       rss=FakeRss(per_sample, jitter))
    assert summary["leak"] is leak, summary["rss"]


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


def test_the_soak_figure_shows_the_worst_call():
    """A median-only latency line hid a 1,640 ms step: the panels carry each window's max and the worst
    call of the run, marked."""
    import time

    from flashrt.bench.soak import soak_panels

    summary = run_soak(lambda i: time.sleep(0.05 if i == 123 else 0), SoakConfig(steps=300, warmup=20))
    assert summary["worst"]["step"] == 123 and summary["worst"]["ms"] >= 50
    assert summary["per_step_ms"][123] == summary["worst"]["ms"] == summary["latency"].max
    _, latency = soak_panels({"soak": summary, "benchmark": "x"})
    series = latency[3]
    assert max(series["max"][1]) == summary["worst"]["ms"] and max(series["median"][1]) < 50
    (marked,) = [v for k, v in series.items() if k.startswith("worst call")]
    assert marked == ([123], [summary["worst"]["ms"]], "x")
