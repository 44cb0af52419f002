import math

import torch
from support.bench_fakes import FakeImpl

from flashrt.bench.sidebyside import Attempt, Side, pair_speedups, summarize_pairs
from flashrt.profile.stats import LatencyStats


def _a(ms, status="ok"):
    return Attempt(0, status, ms, 0.0, (0, 0))


def test_pair_speedups_keep_failures():
    a = [_a(1.0), _a(2.0), _a(1.0, "error"), _a(1.0), _a(4.0, "gated-out")]
    b = [_a(2.0), _a(3.0), _a(1.0), _a(5.0, "error"), _a(1.0, "error")]
    s = pair_speedups(a, b)
    assert s[:2] == [2.0, 1.5] and s[2] == 0.0 and s[3] == math.inf and s[4] == 0.0
    summary = summarize_pairs(s)
    assert summary["pairs"] == 5 and summary["pairs_with_failure"] == 3
    assert summary["speedup_median"] == 1.5  # median of [0, 0, 1.5, 2, inf]


def test_side_counts_errors_and_gate_failures():
    side = Side("A", FakeImpl(fail_on=frozenset({1})), "cpu", atol=1e-6, rtol=0)
    x = {"x": torch.ones(2)}
    golden = {"y": torch.full((2,), 2.0)}
    for i in range(4):
        side.attempt(i, x, golden)
    side.attempt(4, x, {"y": torch.full((2,), 3.0)})  # output differs from the golden one
    assert [a.status for a in side.attempts] == ["ok", "error", "ok", "ok", "gated-out"]
    summary = side.summary(rate_hz=1000.0)
    total: LatencyStats = summary["total"]
    assert total.count == 3 and total.failures == 2 and summary["failures"] == 2
    assert total.deadline_misses >= 2 and total.attempts == 5
    assert summary["stages"]["replay"].count == 3
    assert any("injected failure" in e for e in summary["errors"])
    assert len(side.per_call()) == 3
