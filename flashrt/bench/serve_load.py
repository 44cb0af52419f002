"""Open-loop load against the OpenAI speech route: what `flashrt bench serve` measures.

Protocol (the seed's fair-measurement rules):

- **Capacity first.** One cold request (reported apart), then sequential warm requests: single-stream
  TTFA (time to the first audio byte) and whole-request time; capacity = 1 / mean whole-request time.
- **Open loop.** At each load level (a multiple of the capacity) requests arrive by a seeded Poisson
  process, or at the times of a frozen trace (`parse_trace`), and are sent on schedule whatever the
  server does, each with a client timeout; a level is bounded in count and in wall time. Each
  request's lag behind its schedule is recorded (``client_lag_ms``): a large lag means the client,
  not the server, set the pace.
- **The full denominator.** Goodput = requests that got their first audio within their TTFA deadline
  (the level's default, 3x the single-stream warm TTFA, or the trace line's ``deadline_ms``) and
  completed, over ALL offered requests: refusals (503, by code), other errors, client timeouts and late
  first audio all count against it. Only the clients that misbehave on purpose leave the denominator,
  counted apart: ``cancelled`` (hung up after the first audio, or at the trace's ``cancel_s``) and
  ``slow`` (slow consumers: read no audio at all, hold the connection, then leave); what they cost
  the others is what those variants measure. Requests the level's wall-clock cap stopped before they
  were sent are ``unsent`` (also apart).
- Per level: TTFA and whole-request percentiles over the served, RTF (request time / audio seconds),
  refusals by code, errors, timeouts, and the server's own per-stage statistics from ``/health``.
- Playback (`playback_stalls`): a listener who starts playing at the first audio byte and plays each
  byte at the format's rate; ``stall_ms`` is how long the audio ran dry before the next bytes came, in
  all, and ``stalls`` how often. Reported apart from goodput (the deadline is the first audio's): a
  server that answers early and then starves its streams shows here.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Arrival", "Outcome", "LevelResult", "poisson_schedule", "poisson_arrivals", "parse_trace",
           "summarize", "run_request", "run_level", "single_stream", "playback_stalls", "TEXTS"]

TEXTS = (
    "The robot picked up the red cube.",
    "Turn left at the next corner, then stop.",
    "I have finished cleaning the table. What should I do next?",
    "Battery at forty percent.",
    "Please hand me the blue cup on the shelf.",
    "Moving to the charging station now.",
)

_APART = ("cancelled", "slow", "unsent")  # outcomes left out of goodput's denominator (module docstring)


@dataclass(frozen=True)
class Arrival:
    """One request to offer: start (s from the level's start), text, and how its client behaves.

    ``deadline_ms``: its own TTFA deadline (None: the level's); ``cancel_s``: the client hangs up this
    long after its start (None: never); ``hang_up``: it hangs up after its first audio; ``slow``: it
    reads no audio at all (a slow consumer)."""

    t: float
    text: str
    deadline_ms: float | None = None
    cancel_s: float | None = None
    hang_up: bool = False
    slow: bool = False


@dataclass
class Outcome:
    """One offered request, as the client saw it (times in ms from its actual start)."""

    index: int
    scheduled_s: float
    status: int | None = None         # HTTP status; None: no response (timeout, connection error)
    code: str | None = None           # the OpenAI error code of a refusal or error
    ttfa_ms: float | None = None      # first audio byte
    total_ms: float | None = None     # last byte
    audio_s: float = 0.0
    bytes: int = 0
    error: str | None = None          # "timeout", "cancelled", "slow", "unsent", or the exception's class
    deadline_ms: float | None = None  # its own TTFA deadline (None: the level's)
    lag_ms: float | None = None       # how late the client sent it against its schedule
    stall_ms: float | None = None     # playback ran dry this long in all (`playback_stalls`; served only)
    stalls: int = 0                   # ... this many times

    @property
    def served(self) -> bool:
        return self.status == 200 and self.error is None and self.total_ms is not None


def poisson_schedule(rate_per_s: float, count: int, seed: int) -> list[float]:
    """Start times (s from 0) of `count` Poisson arrivals at `rate_per_s`, reproducible in `seed`."""
    if not rate_per_s > 0 or not math.isfinite(rate_per_s) or count < 0:
        raise ValueError(f"rate {rate_per_s} must be positive and finite and count {count} non-negative")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def poisson_arrivals(rate_per_s: float, count: int, seed: int, texts: Sequence[str],
                     hang_up_every: int = 0, slow_every: int = 0) -> list[Arrival]:
    """`poisson_schedule` as arrivals: texts in turn; every ``hang_up_every``-th client hangs up after
    its first audio, every ``slow_every``-th reads nothing (0: none; a client that is both is slow)."""
    def every(n: int, i: int) -> bool:
        return bool(n) and i % n == n - 1

    return [Arrival(t, texts[i % len(texts)], hang_up=every(hang_up_every, i) and not every(slow_every, i),
                    slow=every(slow_every, i))
            for i, t in enumerate(poisson_schedule(rate_per_s, count, seed))]


_TRACE_KEYS = {"t", "text", "deadline_ms", "cancel_s"}


def parse_trace(path: str | Path) -> list[Arrival]:
    """A frozen trace: JSONL, one request a line, ``{"t": start_s, "text": str, "deadline_ms": optional,
    "cancel_s": optional}``, in any order (replayed sorted by ``t``; blank lines skipped). Any bad line
    is one ConfigError naming the file, the line and what is wrong; unknown keys are errors."""
    from flashrt.errors import ConfigError

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--trace {path}: cannot read it ({exc})") from None
    arrivals = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                arrivals.append(_trace_line(line))
            except ValueError as exc:
                raise ConfigError(f"--trace {path}, line {number}: {exc}") from None
    if not arrivals:
        raise ConfigError(f"--trace {path}: no requests (one JSON object a line: "
                          '{"t": 0.5, "text": "...", "deadline_ms": 300, "cancel_s": 2.0})')
    return sorted(arrivals, key=lambda a: a.t)


def _trace_line(line: str) -> Arrival:
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {type(item).__name__}")
    if unknown := sorted(set(item) - _TRACE_KEYS):
        raise ValueError(f"unknown keys {unknown} (known: {sorted(_TRACE_KEYS)})")
    text = item.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("'text' must be a non-empty string")
    t = _number(item, "t", minimum=0.0, required=True)
    deadline = _number(item, "deadline_ms", minimum=0.0, strict=True)
    return Arrival(t, text, deadline, _number(item, "cancel_s", minimum=0.0))


def _number(item: dict[str, Any], key: str, minimum: float, required: bool = False,
            strict: bool = False) -> float | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key!r} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{key!r} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def playback_stalls(chunks: Sequence[tuple[float, int]], bytes_per_s: float) -> tuple[float, int]:
    """(ms the audio ran dry in all, times it did) for ``chunks`` (arrival s, bytes) in arrival order,
    played from the first one's arrival at ``bytes_per_s``: the bytes received before a chunk last until
    the playback start + their duration + the stalls so far; a chunk that comes later stalls playback
    until it does."""
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s}")
    if not chunks:
        return 0.0, 0
    start, played, stalled, stalls = chunks[0][0], 0, 0.0, 0
    for t, size in chunks:
        dry = start + played / bytes_per_s + stalled
        if t > dry:
            stalled, stalls = stalled + (t - dry), stalls + 1
        played += size
    return stalled * 1e3, stalls


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
    goodput: float                  # on-time served / offered (less the clients counted apart)
    served: int
    on_time: int
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    cancelled: int = 0              # hung up by the client on purpose (left out of goodput's denominator)
    slow: int = 0                   # slow consumers (left out of the denominator)
    unsent: int = 0                 # stopped by the level's wall-clock cap before being sent (left out)
    ttfa_ms: dict[str, Any] = field(default_factory=dict)
    total_ms: dict[str, Any] = field(default_factory=dict)
    rtf: dict[str, Any] = field(default_factory=dict)
    client_lag_ms: dict[str, Any] = field(default_factory=dict)
    stalled: int = 0                # served requests whose playback ran dry at least once
    stall_ms: dict[str, Any] = field(default_factory=dict)  # over the served
    wall_s: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _refused(o: Outcome) -> bool:
    return o.status in (429, 503)


def summarize(load: float, rate: float, outcomes: Sequence[Outcome], deadline_ms: float) -> LevelResult:
    """A level's figures over every offered request (module docstring: the full denominator); each
    offered request lands in exactly one of served / refused / errors / timeouts / cancelled / slow /
    unsent."""
    served = [o for o in outcomes if o.served]
    on_time = [o for o in served if o.ttfa_ms is not None
               and o.ttfa_ms <= (deadline_ms if o.deadline_ms is None else o.deadline_ms)]
    apart = {kind: sum(1 for o in outcomes if o.error == kind and not o.served) for kind in _APART}
    refused: dict[str, int] = {}
    for o in outcomes:
        if _refused(o) and o.error not in _APART:
            refused[o.code or str(o.status)] = refused.get(o.code or str(o.status), 0) + 1
    timeouts = sum(1 for o in outcomes if o.error == "timeout")
    errors = sum(1 for o in outcomes
                 if not o.served and not _refused(o) and o.error not in ("timeout", *_APART))
    rtf = [o.total_ms / 1e3 / o.audio_s for o in served if o.audio_s > 0]
    counted = len(outcomes) - sum(apart.values())
    return LevelResult(load, rate, len(outcomes), len(on_time) / counted if counted else 0.0,
                       len(served), len(on_time), refused, errors, timeouts, apart["cancelled"],
                       apart["slow"], apart["unsent"],
                       _percentiles([o.ttfa_ms for o in served if o.ttfa_ms is not None]),
                       _percentiles([o.total_ms for o in served]), _percentiles(rtf),
                       _percentiles([o.lag_ms for o in outcomes if o.lag_ms is not None]),
                       stalled=sum(1 for o in served if o.stalls),
                       stall_ms=_percentiles([o.stall_ms for o in served if o.stall_ms is not None]),
                       requests=[asdict(o) for o in outcomes])


async def run_request(client: Any, url: str, body: dict[str, Any], outcome: Outcome, timeout_s: float,
                      bytes_per_s: float, arrival: Arrival | None = None,
                      slow_hold_s: float = 5.0) -> Outcome:
    """POST one speech request, streaming, as `arrival`'s client behaves; fills `outcome` (never raises)."""
    behaviour = arrival or Arrival(0.0, body.get("input", ""))
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            hang_up = asyncio.timeout(behaviour.cancel_s)
            try:
                async with hang_up:
                    await _exchange(client, url, body, outcome, start, behaviour, bytes_per_s, slow_hold_s)
            except TimeoutError:
                if not hang_up.expired():
                    raise
                outcome.error = "cancelled"  # the trace's cancel time came first
    except TimeoutError:
        outcome.error = "timeout"
    except Exception as exc:  # noqa: BLE001 - counted, never raised: the level goes on
        outcome.error = type(exc).__name__
    return outcome


async def _exchange(client: Any, url: str, body: dict[str, Any], outcome: Outcome, start: float,
                    behaviour: Arrival, bytes_per_s: float, slow_hold_s: float) -> None:
    async with client.stream("POST", url, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.code = _error_code(await response.aread())
            return
        if behaviour.slow:  # a slow consumer: reads no audio, holds the connection, then leaves
            await asyncio.sleep(slow_hold_s)
            outcome.error = "slow"
            return
        chunks: list[tuple[float, int]] = []
        async for chunk in response.aiter_bytes():
            if not chunk:
                continue
            now = time.perf_counter()
            if outcome.ttfa_ms is None:
                outcome.ttfa_ms = (now - start) * 1e3
            chunks.append((now, len(chunk)))
            outcome.bytes += len(chunk)
            if behaviour.hang_up:
                outcome.error = "cancelled"  # a client that hangs up after its first audio
                return
        outcome.total_ms = (time.perf_counter() - start) * 1e3
        outcome.audio_s = outcome.bytes / bytes_per_s
        outcome.stall_ms, outcome.stalls = playback_stalls(chunks, bytes_per_s)


def _error_code(data: bytes) -> str | None:
    try:
        return json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _body(voice: str, text: str, seed: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": "tts-1", "voice": voice, "input": text, "response_format": "pcm", "seed": seed,
            **(extra or {})}


async def run_level(url: str, voice: str, arrivals: Sequence[Arrival], timeout_s: float, bytes_per_s: float,
                    wall_cap_s: float, deadline_ms: float | None = None, slow_hold_s: float = 5.0
                    ) -> list[Outcome]:
    """Send one request per arrival at its time (open loop), each with `timeout_s`; the level ends by
    `wall_cap_s` (what is still running then is a timeout; what was not sent yet is ``unsent``).
    `deadline_ms` (admission on): each request carries its deadline as ``ttfa_deadline_ms``."""
    import httpx

    endpoint = f"{url}/v1/audio/speech"
    outcomes = [Outcome(i, a.t, deadline_ms=a.deadline_ms) for i, a in enumerate(arrivals)]
    limits = httpx.Limits(max_connections=len(arrivals) + 1, max_keepalive_connections=len(arrivals) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(o: Outcome, a: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, a.t - (time.perf_counter() - t0)))
            o.lag_ms = (time.perf_counter() - t0 - a.t) * 1e3
            own = a.deadline_ms if a.deadline_ms is not None else deadline_ms
            extra = {"ttfa_deadline_ms": own} if deadline_ms is not None and own is not None else None
            return await run_request(client, endpoint, _body(voice, a.text, o.index, extra), o, timeout_s,
                                     bytes_per_s, a, slow_hold_s)

        tasks = [asyncio.ensure_future(one(o, a)) for o, a in zip(outcomes, arrivals)]
        _, pending = await asyncio.wait(tasks, timeout=wall_cap_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for o, task in zip(outcomes, tasks):
            if task in pending and o.total_ms is None and o.error is None:
                o.error = "timeout" if o.lag_ms is not None else "unsent"
    return outcomes


async def single_stream(url: str, voice: str, texts: Sequence[str], count: int, timeout_s: float,
                        bytes_per_s: float) -> tuple[Outcome, list[Outcome]]:
    """(the cold first request, `count` warm sequential requests)."""
    import httpx

    endpoint = f"{url}/v1/audio/speech"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        results = []
        for i in range(count + 1):
            results.append(await run_request(client, endpoint, _body(voice, texts[i % len(texts)], i, None),
                                             Outcome(i, 0.0), timeout_s, bytes_per_s))
    return results[0], results[1:]
