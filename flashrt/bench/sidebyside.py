"""Timed attempts of one or two implementations, interleaved A/B/A/B on the same frozen trace.

Every attempt is counted. An attempt that raises, or whose output fails the quality gate, is a
failure: it enters the failures of its side (so the deadline-miss rate and every rate keep the full
denominator) and its pair. Per-pair speedup is `b_ms / a_ms` (> 1: A is faster); a pair where A failed
counts as 0 (the worst case for A), one where only B failed as +inf (the best case for A), so the
median over all pairs never drops an attempt.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from flashrt.bench.gate import compare
from flashrt.profile.stats import LatencyStats, percentile
from flashrt.profile.timers import StageTimer

_MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class Attempt:
    """One timed call: status 'ok' | 'error' | 'gated-out', wall time, where its stage records lie."""

    index: int
    status: str
    total_ms: float
    start_ms: float
    records: tuple[int, int]
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Side:
    """One implementation under measurement: its timer, its attempts, their statistics."""

    def __init__(self, label: str, impl: Any, device: str, atol: float, rtol: float):
        self.label, self.impl, self.atol, self.rtol = label, impl, atol, rtol
        self.timer = StageTimer(device)
        self.attempts: list[Attempt] = []
        self.origin_ns = time.perf_counter_ns()

    @property
    def name(self) -> str:
        return getattr(self.impl, "name", self.label)

    def attempt(self, index: int, inputs: Any, golden: Any) -> Attempt:
        """Run once, time it, gate its output against `golden` (outside the timed region)."""
        self.timer.new_call()
        first = len(self.timer)
        start = time.perf_counter_ns()
        status, error, out = "ok", "", None
        try:
            out = self.impl.run(inputs, self.timer)
        except Exception as exc:  # counted, never dropped
            status, error = "error", f"{type(exc).__name__}: {exc}"
        end = time.perf_counter_ns()
        if status == "ok":
            verdict = compare(out, golden, self.atol, self.rtol)
            if not verdict.passed:
                status, error = "gated-out", f"{verdict.where}: {verdict.reason}"
        attempt = Attempt(index, status, (end - start) / 1e6, (start - self.origin_ns) / 1e6,
                          (first, len(self.timer)), error)
        self.attempts.append(attempt)
        return attempt

    def reset(self) -> None:
        """Forget warm-up attempts."""
        self.attempts.clear()
        self.timer.reset()

    @property
    def failures(self) -> int:
        return sum(not a.ok for a in self.attempts)

    def per_call(self) -> list[dict[str, float]]:
        """{stage: ms} of each successful attempt, in order."""
        records = self.timer.records()
        rows = []
        for a in self.attempts:
            if a.ok:
                row: dict[str, float] = {}
                for r in records[a.records[0]:a.records[1]]:
                    row[r.stage] = row.get(r.stage, 0.0) + r.ms
                rows.append(row)
        return rows

    def summary(self, rate_hz: float | None) -> dict[str, Any]:
        """Total and per-stage LatencyStats (successful attempts; failures in the total's denominator)."""
        rows = self.per_call()
        stages = list(dict.fromkeys(k for row in rows for k in row))
        totals = [a.total_ms for a in self.attempts if a.ok]
        errors = list(dict.fromkeys(a.error for a in self.attempts if not a.ok))[:_MAX_ERRORS_KEPT]
        return {"name": self.name, "attempts": len(self.attempts), "failures": self.failures,
                "errors": errors,
                "total": LatencyStats.from_samples(totals, rate_hz, failures=self.failures),
                "stages": {s: LatencyStats.from_samples([r[s] for r in rows if s in r], rate_hz)
                           for s in stages}}


def pair_speedups(a: list[Attempt], b: list[Attempt]) -> list[float]:
    """b_ms / a_ms per pair (see module doc for failed attempts)."""
    out = []
    for x, y in zip(a, b):
        if not x.ok:
            out.append(0.0)
        elif not y.ok:
            out.append(float("inf"))
        else:
            out.append(y.total_ms / x.total_ms if x.total_ms > 0 else float("inf"))
    return out


def summarize_pairs(speedups: list[float]) -> dict[str, Any]:
    """Median and spread of the per-pair speedups, with the count of pairs and of failed ones."""
    ordered = sorted(speedups)
    failed = sum(s == 0.0 or s == float("inf") for s in ordered)
    spread = lambda q: percentile(ordered, q) if ordered else None  # inf/NaN become null in JSON
    return {"pairs": len(ordered), "pairs_with_failure": failed,
            "speedup_median": statistics.median(ordered) if ordered else None,
            "speedup_p10": spread(10), "speedup_p90": spread(90)}


def interleave(sides: list[Side], trace: Any, golden: list[Any], iters: int, progress: Any = None) -> None:
    """`iters` rounds; each round runs every side once on the same trace input, in order (A, B)."""
    for i in range(iters):
        for side in sides:
            side.attempt(i, trace[i], golden[i % len(golden)])
        if progress is not None:
            progress.update(1)
