"""Open-loop load against the OpenAI speech route: what `flashrt bench serve` measures.

Protocol (the seed's fair-measurement rules):

- **Capacity first.** One cold request (reported apart), then sequential warm requests: single-stream
  TTFA (time to the first audio byte) and whole-request time; capacity = 1 / mean whole-request time.
- **Open loop.** At each load level (a multiple of the capacity) requests arrive by a seeded Poisson
  process and are sent on schedule whatever the server does, each with a client timeout; a level is
  bounded in count and in wall time.
- **The full denominator.** Goodput = requests that got their first audio within the TTFA deadline
  (default 3x the single-stream warm TTFA) and completed, over ALL offered requests: refusals (503,
  by code), other errors, client timeouts and late first audio all count against it. Only requests
  the client itself cancels (the hang-up variant) leave the denominator; they are counted apart.
- Per level: TTFA and whole-request percentiles over the served, RTF (request time / audio seconds),
  refusals by code, errors, timeouts, and the server's own per-stage statistics from ``/health``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Outcome", "LevelResult", "poisson_schedule", "summarize", "run_request", "run_level",
           "single_stream", "TEXTS"]

TEXTS = (
    "The robot picked up the red cube.",
    "Turn left at the next corner, then stop.",
    "I have finished cleaning the table. What should I do next?",
    "Battery at forty percent.",
    "Please hand me the blue cup on the shelf.",
    "Moving to the charging station now.",
)


@dataclass
class Outcome:
    """One offered request, as the client saw it (times in ms from its scheduled start)."""

    index: int
    scheduled_s: float
    status: int | None = None         # HTTP status; None: no response (timeout, connection error)
    code: str | None = None           # the OpenAI error code of a refusal or error
    ttfa_ms: float | None = None      # first audio byte
    total_ms: float | None = None     # last byte
    audio_s: float = 0.0
    error: str | None = None          # "timeout", or the exception's class

    @property
    def served(self) -> bool:
        return self.status == 200 and self.error is None and self.total_ms is not None


def poisson_schedule(rate_per_s: float, count: int, seed: int) -> list[float]:
    """Start times (s from 0) of `count` Poisson arrivals at `rate_per_s`, reproducible in `seed`."""
    if rate_per_s <= 0 or count < 0:
        raise ValueError(f"rate {rate_per_s} must be positive and count {count} non-negative")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1], "count": len(ordered)}


@dataclass
class LevelResult:
    load: float                     # offered rate as a multiple of the single-stream capacity
    rate_per_s: float
    offered: int
    goodput: float                  # on-time served / offered
    served: int
    on_time: int
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    cancelled: int = 0              # hung up by the client on purpose (left out of goodput's denominator)
    ttfa_ms: dict[str, Any] = field(default_factory=dict)
    total_ms: dict[str, Any] = field(default_factory=dict)
    rtf: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(load: float, rate: float, outcomes: Sequence[Outcome], deadline_ms: float) -> LevelResult:
    """A level's figures over every offered request (module docstring: the full denominator)."""
    served = [o for o in outcomes if o.served]
    on_time = [o for o in served if o.ttfa_ms is not None and o.ttfa_ms <= deadline_ms]
    refused: dict[str, int] = {}
    for o in outcomes:
        if o.status is not None and o.status != 200 and o.status in (429, 503):
            refused[o.code or str(o.status)] = refused.get(o.code or str(o.status), 0) + 1
    cancelled = sum(1 for o in outcomes if o.error == "cancelled")
    errors = sum(1 for o in outcomes if not o.served and o.error not in ("timeout", "cancelled")
                 and o.status not in (429, 503))
    timeouts = sum(1 for o in outcomes if o.error == "timeout")
    rtf = [o.total_ms / 1e3 / o.audio_s for o in served if o.audio_s > 0]
    counted = len(outcomes) - cancelled
    return LevelResult(load, rate, len(outcomes), len(on_time) / counted if counted else 0.0,
                       len(served), len(on_time), refused, errors, timeouts, cancelled,
                       _percentiles([o.ttfa_ms for o in served if o.ttfa_ms is not None]),
                       _percentiles([o.total_ms for o in served]), _percentiles(rtf))


async def run_request(client: Any, url: str, body: dict[str, Any], outcome: Outcome, timeout_s: float,
                      bytes_per_s: float, read: bool = True) -> Outcome:
    """POST one speech request, streaming; fills `outcome` (never raises)."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    data = await response.aread()
                    outcome.code = _error_code(data)
                    return outcome
                received = 0
                async for chunk in response.aiter_bytes():
                    if outcome.ttfa_ms is None and chunk:
                        outcome.ttfa_ms = (time.perf_counter() - start) * 1e3
                    received += len(chunk)
                    if not read:
                        outcome.error = "cancelled"  # a client that hangs up after its first audio
                        return outcome
                outcome.total_ms = (time.perf_counter() - start) * 1e3
                outcome.audio_s = received / bytes_per_s
    except TimeoutError:
        outcome.error = "timeout"
    except Exception as exc:  # noqa: BLE001 - counted, never raised: the level goes on
        outcome.error = type(exc).__name__
    return outcome


def _error_code(data: bytes) -> str | None:
    import json

    try:
        return json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def run_level(url: str, voice: str, schedule: Sequence[float], texts: Sequence[str],
                    timeout_s: float, bytes_per_s: float, wall_cap_s: float,
                    extra: dict[str, Any] | None = None, cancel_every: int = 0) -> list[Outcome]:
    """Send one request per scheduled start (open loop), each with `timeout_s`; ends by `wall_cap_s`."""
    import httpx

    endpoint = f"{url}/v1/audio/speech"
    outcomes = [Outcome(i, t) for i, t in enumerate(schedule)]
    limits = httpx.Limits(max_connections=len(schedule) + 1, max_keepalive_connections=len(schedule) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(o: Outcome) -> Outcome:
            await asyncio.sleep(max(0.0, o.scheduled_s - (time.perf_counter() - t0)))
            body = {"model": "tts-1", "voice": voice, "input": texts[o.index % len(texts)],
                    "response_format": "pcm", "seed": o.index, **(extra or {})}
            hang_up = bool(cancel_every) and o.index % cancel_every == cancel_every - 1
            return await run_request(client, endpoint, body, o, timeout_s, bytes_per_s, read=not hang_up)

        tasks = [asyncio.ensure_future(one(o)) for o in outcomes]
        done, pending = await asyncio.wait(tasks, timeout=wall_cap_s)
        for task in pending:
            task.cancel()
        for o, task in zip(outcomes, tasks):
            if task in pending and o.total_ms is None and o.error is None:
                o.error = "timeout"
    return outcomes


async def single_stream(url: str, voice: str, texts: Sequence[str], count: int, timeout_s: float,
                        bytes_per_s: float) -> tuple[Outcome, list[Outcome]]:
    """(the cold first request, `count` warm sequential requests)."""
    import httpx

    endpoint = f"{url}/v1/audio/speech"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        results = []
        for i in range(count + 1):
            body = {"model": "tts-1", "voice": voice, "input": texts[i % len(texts)],
                    "response_format": "pcm", "seed": i}
            results.append(await run_request(client, endpoint, body, Outcome(i, 0.0), timeout_s, bytes_per_s))
    return results[0], results[1:]
