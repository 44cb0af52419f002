"""Latency statistics: percentiles, jitter and deadline misses from a list of per-call milliseconds.

Percentiles use linear interpolation between closest ranks (numpy's default 'linear' method), written
out here so the numbers do not depend on a library default. Failed calls are counted, never dropped:
they enter `failures`, and each one is also a deadline miss when a rate is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields


def percentile(sorted_ms: list[float], q: float) -> float:
    """q-th percentile (0..100) of an ascending list, linear interpolation; NaN when empty."""
    if not sorted_ms:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    pos = (len(sorted_ms) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def _clean(value: float) -> float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass(frozen=True)
class LatencyStats:
    """Summary of per-call latencies in milliseconds.

    count: successful samples; failures: calls that raised or were gated out (in the denominator);
    jitter: p99 / p50; deadline_ms: 1000 / rate_hz; deadline_misses: samples over the deadline plus
    failures; miss_rate: deadline_misses / (count + failures).
    """

    count: int
    failures: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float
    jitter: float
    rate_hz: float | None = None
    deadline_ms: float | None = None
    deadline_misses: int | None = None
    miss_rate: float | None = None

    @classmethod
    def from_samples(cls, ms: Iterable[float], rate_hz: float | None = None,
                     failures: int = 0) -> LatencyStats:
        """Statistics of `ms` (per-call milliseconds); deadline misses are counted at `rate_hz`."""
        data = sorted(float(x) for x in ms)
        if any(not math.isfinite(x) for x in data):
            raise ValueError("latency samples must be finite; count failed calls with failures=")
        if failures < 0:
            raise ValueError(f"failures must be >= 0, got {failures}")
        p50, p90, p99 = (percentile(data, q) for q in (50.0, 90.0, 99.0))
        return cls(count=len(data), failures=failures, mean=_mean(data), std=_std(data),
                   min=data[0] if data else math.nan, p50=p50, p90=p90, p99=p99,
                   max=data[-1] if data else math.nan, jitter=_ratio(p99, p50),
                   **_deadline(data, rate_hz, failures))

    @property
    def attempts(self) -> int:
        """Successful samples plus failures: the denominator of every rate."""
        return self.count + self.failures

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-ready dict (NaN and inf become None); keys are `LatencyStats.keys()`."""
        return {k: _clean(v) for k, v in asdict(self).items()}

    @staticmethod
    def keys() -> tuple[str, ...]:
        """The stable key set of `to_dict()`."""
        return tuple(f.name for f in fields(LatencyStats))


def _mean(data: list[float]) -> float:
    return math.fsum(data) / len(data) if data else math.nan


def _std(data: list[float]) -> float:
    if not data:
        return math.nan
    mean = _mean(data)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in data) / len(data))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 and math.isfinite(den) else math.nan


def _deadline(data: list[float], rate_hz: float | None, failures: int) -> dict[str, float | int | None]:
    if rate_hz is None:
        return {}
    if not rate_hz > 0:
        raise ValueError(f"rate_hz must be > 0, got {rate_hz}")
    deadline = 1000.0 / rate_hz
    misses = sum(x > deadline for x in data) + failures
    attempts = len(data) + failures
    return {"rate_hz": float(rate_hz), "deadline_ms": deadline, "deadline_misses": misses,
            "miss_rate": misses / attempts if attempts else math.nan}
