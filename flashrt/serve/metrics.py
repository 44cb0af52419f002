"""Prometheus metrics of the speech and policy servers (`GET /metrics`, text exposition format).

One registry per server (several servers in a process, as in tests, never share counters). The speech
server (`SpeechMetrics`):

    flashrt_speech_requests_total{voice, status, code}   every answered request (code "" when 200)
    flashrt_speech_ttfa_seconds{voice}                    histogram: arrival -> first audio ready
    flashrt_speech_request_seconds{voice}                 histogram: arrival -> last byte handed over
    flashrt_speech_queue_depth{voice, state}              gauge at scrape time: queued / running
    flashrt_speech_batch_fill{voice, stage}               gauge: mean items per call / max_batch of a
                                                          batched stage (absent for sequential stages)

The policy server (`PolicyMetrics`, ``flashrt serve-policy``):

    flashrt_policy_requests_total{outcome}       every answered message: "ok" or the error reply's code
    flashrt_policy_step_seconds                  histogram: message received -> reply sent
    flashrt_policy_connections_refused_total     connections closed at once, beyond max_connections
    flashrt_policy_connections                   gauge at scrape time: connections open
    flashrt_policy_queue_depth                   gauge: requests decoded and waiting for the policy
    flashrt_policy_bytes_held                    gauge: bytes of messages held (the server_busy budget)

Needs ``prometheus_client`` (in the ``serve`` extra); without it the route answers 501 naming the extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SpeechMetrics", "PolicyMetrics", "available", "render", "MISSING"]

BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
MISSING = "metrics need the prometheus_client package (pip install 'flashrt[serve]')"


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class SpeechMetrics:
    """The server's metrics; `render()` is the exposition text and its content type."""

    def __init__(self, chains: dict[str, Any]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flashrt_speech_requests", "Answered speech requests",
                                ("voice", "status", "code"), registry=self.registry)
        self.ttfa = Histogram("flashrt_speech_ttfa_seconds", "Request arrival to its first audio",
                              ("voice",), buckets=BUCKETS_S, registry=self.registry)
        self.total = Histogram("flashrt_speech_request_seconds", "Request arrival to its last byte",
                               ("voice",), buckets=BUCKETS_S, registry=self.registry)
        self.registry.register(_ChainCollector(chains))

    def answered(self, voice: str, status: int, code: str = "") -> None:
        self.requests.labels(voice or "-", str(status), code).inc()

    def render(self) -> tuple[bytes, str]:
        return render(self.registry)


def render(registry: Any) -> tuple[bytes, str]:
    """The exposition text of `registry` and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


class _ChainCollector:
    """Queue depth and batch fill read from the chains at scrape time."""

    def __init__(self, chains: dict[str, Any]) -> None:
        self.chains = chains

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        depth = GaugeMetricFamily("flashrt_speech_queue_depth", "Requests held per voice",
                                  labels=("voice", "state"))
        fill = GaugeMetricFamily("flashrt_speech_batch_fill", "Mean batch fill of a batched stage",
                                 labels=("voice", "stage"))
        for voice, chain in self.chains.items():
            stats = chain.stats()
            depth.add_metric((voice, "queued"), stats["queued"])
            depth.add_metric((voice, "running"), stats["running"])
            for stage, summary in stats["stages"].items():
                if "fill" in summary and summary["fill"].get("mean") is not None:
                    fill.add_metric((voice, stage), summary["fill"]["mean"])
        yield depth
        yield fill


class PolicyMetrics:
    """The policy server's metrics (module docstring); `load` reads its gauges at scrape time."""

    def __init__(self, load: Callable[[], Mapping[str, float]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flashrt_policy_requests", "Answered policy messages", ("outcome",),
                                registry=self.registry)
        self.step = Histogram("flashrt_policy_step_seconds", "Message received to its reply sent",
                              buckets=STEP_BUCKETS_S, registry=self.registry)
        self.refused = Counter("flashrt_policy_connections_refused", "Connections beyond max_connections",
                               registry=self.registry)
        self.registry.register(_LoadCollector(load))

    def answered(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome).inc()
        self.step.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return render(self.registry)


class _LoadCollector:
    """Gauges read from the policy server at scrape time (`PolicyServer.load`)."""

    HELP = {"connections": "Connections open", "queue_depth": "Requests waiting for the policy",
            "bytes_held": "Bytes of messages held"}

    def __init__(self, load: Callable[[], Mapping[str, float]]) -> None:
        self.load = load

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        for name, value in self.load().items():
            yield GaugeMetricFamily(f"flashrt_policy_{name}", self.HELP.get(name, name), value=value)
