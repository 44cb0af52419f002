"""Prometheus metrics of the speech server (`GET /metrics`, text exposition format).

One registry per server (several servers in a process, as in tests, never share counters):

    flashrt_speech_requests_total{voice, status, code}   every answered request (code "" when 200)
    flashrt_speech_ttfa_seconds{voice}                    histogram: arrival -> first audio ready
    flashrt_speech_request_seconds{voice}                 histogram: arrival -> last byte handed over
    flashrt_speech_queue_depth{voice, state}              gauge at scrape time: queued / running
    flashrt_speech_batch_fill{voice, stage}               gauge: mean items per call / max_batch of a
                                                          batched stage (absent for sequential stages)

Needs ``prometheus_client`` (in the ``serve`` extra); without it the route answers 501 naming the extra.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpeechMetrics", "available"]

BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


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
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


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
