"""`flashrt bench NAME --sweep`: a vocoder against a second implementation at every length, the quality
gate per length, lengths past the adapter's buckets, refusals."""

from __future__ import annotations

import pytest

from flashrt.bench.harness import BenchOptions
from flashrt.bench.sweep import parse_lengths, plot_sweep, run_sweep
from flashrt.errors import ConfigError


def test_sweep_against_the_eager_sibling(tiny_profile, tmp_path):
    record = run_sweep("hifigan", tiny_profile(), BenchOptions(vs="eager"), [5, 17, 300], pairs=1)
    assert record["status"] == "ok" and [r["length"] for r in record["rows"]] == [5, 17, 300]
    for row in record["rows"]:
        assert row["gate"] and row["max_abs_delta"] == 0.0 and row["flashrt_ms"] > 0 and row["ratio"] > 0
        assert row["stream_max_abs_delta"] <= 1e-5
        assert row["flashrt_cpu_ms"] > 0 and row["cpu_ratio"] > 0           # a CPU profile: CPU time too
        low, high = row["cpu_ratio_range"]
        assert low <= row["cpu_ratio"] <= high
    assert record["line"]["min_ratio"] == record["min_ratio"] and record["reference"] == "eager"
    assert len(record["line"]["cpu_ratios"]) == 3
    assert plot_sweep(tmp_path / "sweep.png", record).stat().st_size > 0


def test_sweep_of_a_codes_family(tiny_profile):
    """Codes (3 scales at rates 1, 2, 4) against the trace backend (bucketed, padded): within 1e-5."""
    profile = tiny_profile(quality={"atol": 1e-5, "rtol": 1e-5})
    record = run_sweep("snac", profile, BenchOptions(vs="trace"), [5, 7], pairs=1)
    assert record["status"] == "ok", record["rows"]


def test_lengths_and_refusals(tiny_profile):
    assert parse_lengths("auto") is None and parse_lengths("200, 50,50") == [50, 200]
    for bad in ("a,b", "0,5"):
        with pytest.raises(ConfigError):
            parse_lengths(bad)
    with pytest.raises(ConfigError, match="no length sweep"):
        run_sweep("runtime-block", tiny_profile(), BenchOptions(vs="eager"), [4], pairs=1)
    with pytest.raises(ConfigError, match="pairs"):
        run_sweep("hifigan", tiny_profile(), BenchOptions(vs="eager"), [4], pairs=0)
