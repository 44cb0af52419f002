"""The local chain: stages joined by bounded channels, one worker thread per stage, requests in order.

    chain = Chain([Stage("lm", tokens_of), Stage.map("frames", to_frame), Stage("vocoder", audio_of)])
    for chunk in chain.stream("hello"):          # or: async for chunk in chain.astream("hello")
        play(chunk)
    req = chain.submit("hi", priority=-1)        # a handle: iterate it, req.cancel(), req.state
    chain.stats()                                # per-stage LatencyStats, queue depths, time to first item

A stage is ``fn(items, request) -> iterable``: it consumes the items of the stage before it (the first
stage gets one item, the request's payload) and yields its own, so one item in may give many out (an LM:
text -> tokens) or many one (frames -> audio chunk). `Stage.map` wraps a per-item function.
`Stage.batched(name, fn, max_batch)` declares a one-to-one stage whose ``fn(items, requests)`` serves
items of several requests in one call (a codec decoding the windows of many streams): its worker
(`flashrt.chain.batched`) gathers one ready item per request, routes each output back to its request,
and keeps cancel, errors and backpressure per request. `Stage.continuous(name, engine)` declares a
first stage whose requests join a running engine when a place is free and leave when done (an LM
decoding many sequences in one captured step: `flashrt.chain.continuous`). Other stages serve
requests one after another.

Semantics, per request:

* Streaming: every stage of a request runs at once, each in its stage's worker; items move as soon as
  they are yielded. Requests are served in submission order within a priority (lower number first);
  stage k starts request r+1 as soon as it is done with r, so requests pipeline through the stages.
* Backpressure: each link is a `Channel` of ``queue_size`` items, the last one feeding the caller. A
  full channel blocks its producer; a slow consumer stalls the whole request, never buffers it. With
  ``send_timeout_s`` set, a caller that takes nothing for that long while its channel is full (a client
  that stopped reading) has its request cancelled (`SlowConsumer` is what its iteration then raises, and
  ``request.reason`` says ``"send_timeout"``), so the stage serves the next request.
* Cancel: `Request.cancel()` (or abandoning the iteration, or cancelling the async task) closes every
  channel of the request; each stage's blocked put/get wakes and the stage drops the request at its
  next item. The generator of each stage is closed (its ``finally`` runs). Slots are freed at once.
* Errors: an exception in a stage ends that request only: the caller's iteration raises `StageError`
  naming the stage, with the original exception as ``__cause__`` and ``.original``; the other stages
  of the request stop as on cancel; the next request runs normally. That holds for any behaviour of a
  stage: ``SystemExit`` / ``KeyboardInterrupt`` raised inside it, or a generator that swallows
  ``GeneratorExit`` when closed, end its request, never the worker.
* Capacity: at most ``max_pending`` requests queued or running; `submit` beyond raises `ChainFull`
  (a server answers 503).
* Admission: `estimate_first_item_ms()` predicts when a request submitted now would give its first item,
  from the measured time each request held the first stage, the measured lag from a request's start to
  its first item, and the requests queued or running now, with as many places as the first stage has
  (one, or a continuous stage's capacity); None before anything was measured, or when the first stage
  is batched. A server refuses at once what would miss its deadline.

Threads, not asyncio (DESIGN.md section 7): the stages are blocking torch calls that release the GIL
(graph replays, GEMMs), so threads overlap them for real with no executor hop; the async API waits on
the caller-facing channel with an asyncio future (`Channel.aget`), so a waiting request holds no
thread of any executor, however many are queued.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from flashrt.chain.batched import BatchedWorker
from flashrt.chain.channel import Channel, Closed, Finished, SendTimeout
from flashrt.chain.continuous import ContinuousWorker, Engine
from flashrt.errors import ConfigError, FlashRTError
from flashrt.profile.stats import LatencyStats

__all__ = ["Chain", "Stage", "Request", "StageError", "ChainFull", "SlowConsumer"]

log = logging.getLogger(__name__)

KEEP_SAMPLES = 4096  # per-stage timing samples kept (a ring: memory stays bounded over a long run)
ESTIMATE_SAMPLES = 64  # recent requests the admission estimate averages over
_STOP = object()


class StageError(FlashRTError):
    """A stage raised while serving a request. ``stage`` names it; ``original`` is the exception."""

    def __init__(self, stage: str, request_id: str, original: BaseException) -> None:
        self.stage, self.request_id, self.original = stage, request_id, original
        super().__init__(f"stage {stage!r} failed on request {request_id!r}: "
                         f"{type(original).__name__}: {original}")


class SlowConsumer(FlashRTError):
    """The request's caller took no item for ``send_timeout_s`` while its channel was full: cancelled."""


class ChainFull(FlashRTError):
    """`submit` refused: the chain already holds ``max_pending`` requests."""


class _Cancelled(BaseException):
    """Raised inside a stage's input iterator when its request ends early (not an Exception on purpose,
    so a stage's own ``except Exception`` cannot swallow a cancel)."""


@dataclass(frozen=True)
class Stage:
    """One step of a chain: ``fn(items, request) -> iterable of items`` (module docstring)."""

    name: str
    fn: Any  # fn(items, request) -> iterable; a batched fn(items, requests); a continuous stage's Engine
    max_batch: int = 0  # 0: serves one request at a time; else a batched stage (`Stage.batched`)
    is_continuous: bool = False  # an engine that requests join and leave (`Stage.continuous`)

    @classmethod
    def map(cls, name: str, fn: Callable[[Any], Any]) -> Stage:
        """A stage applying ``fn`` to each item."""
        return cls(name, lambda items, request: (fn(item) for item in items))

    @classmethod
    def batched(cls, name: str, fn: Callable[[list[Any], list[Request]], Iterable[Any]],
                max_batch: int) -> Stage:
        """A one-to-one stage serving up to ``max_batch`` requests' items per call:
        ``fn(items, requests) -> outputs`` (one per item, in order; `flashrt.chain.batched`)."""
        if int(max_batch) < 1:
            raise ConfigError(f"stage {name!r}: max_batch must be at least 1, got {max_batch}")
        return cls(name, fn, int(max_batch))

    @classmethod
    def continuous(cls, name: str, engine: Any) -> Stage:
        """A first stage that steps up to ``engine.capacity`` requests together, each joining when a
        place is free and leaving when done (`flashrt.chain.continuous`: the `Engine` protocol)."""
        if not isinstance(engine, Engine) or int(engine.capacity) < 1:
            raise ConfigError(f"stage {name!r}: a continuous stage needs an Engine (join, leave, pause, "
                              f"step) with a capacity of at least 1, got {engine!r}")
        return cls(name, engine, is_continuous=True)


class _StageStats:
    """Per-stage samples: service ms per item (time inside the stage, input waits excluded), ms blocked
    on a full output channel per request, the output channel's depth after each put; the deepest seen."""

    def __init__(self) -> None:
        self.service: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self.blocked: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self.depth: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self.items = 0
        self.max_depth = 0
        self.failures = 0
        self.batch: deque[float] = deque(maxlen=KEEP_SAMPLES)  # items per call (batched stages)
        self.fill: deque[float] = deque(maxlen=KEEP_SAMPLES)   # items per call / max_batch
        self.extra: Callable[[], dict[str, Any]] | None = None  # a worker's live counts (continuous)

    def record_batch(self, size: int, max_batch: int) -> None:
        self.batch.append(float(size))
        self.fill.append(size / max_batch)

    def summary(self) -> dict[str, Any]:
        out = {"service_ms": LatencyStats.from_samples(self.service, failures=self.failures).to_dict(),
               "blocked_ms": LatencyStats.from_samples(self.blocked).to_dict(),
               "queue_depth": LatencyStats.from_samples(self.depth).to_dict(),
               "items": self.items, "max_queue_depth": self.max_depth}
        if self.batch:
            out["batch"] = LatencyStats.from_samples(self.batch).to_dict()
            out["fill"] = LatencyStats.from_samples(self.fill).to_dict()
        if self.extra is not None:
            out.update(self.extra())
        return out


class Request:
    """A submitted request: iterate it for its items (sync or async), `cancel()` it, read its state.

    state: "queued" -> "running" -> "done" | "failed" | "cancelled". ``first_item_ms`` and ``total_ms``
    are measured from `submit` to the first item / the end handed to the caller."""

    def __init__(self, chain: Chain, payload: Any, priority: int, request_id: str, bound: int,
                 seq: int = 0) -> None:
        self.chain, self.payload, self.priority, self.id, self.seq = chain, payload, priority, request_id, seq
        self.channels = [Channel(bound) for _ in chain.stages]  # channels[k] = output of stage k
        self.state = "queued"
        self.reason: str | None = None  # why a request ended early: "send_timeout", or None
        self.error: FlashRTError | None = None
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when the first stage took it
        self.first_item_ms: float | None = None
        self.total_ms: float | None = None
        self._lock = threading.Lock()
        self.ended = threading.Event()

    # ------------------------------------------------------------------------------ control
    def cancel(self) -> None:
        """Stop every stage of this request within one item and free its channels."""
        self._end("cancelled")

    def _end(self, state: str, error: FlashRTError | None = None, reason: str | None = None) -> bool:
        with self._lock:
            if self.state in ("done", "failed", "cancelled"):
                return False
            self.state, self.error, self.reason = state, error, reason
        if state != "done":
            for ch in self.channels:
                ch.close()
        self.total_ms = (time.perf_counter() - self.submitted) * 1e3
        self.ended.set()
        self.chain._retire(self)
        return True

    def _mark_running(self) -> None:
        with self._lock:
            self.state = "running" if self.state == "queued" else self.state
            self.started = time.perf_counter()
        self.chain._queue_ms.append((self.started - self.submitted) * 1e3)

    def _fail(self, stage: str, exc: BaseException) -> None:
        self._end("failed", StageError(stage, self.id, exc))

    def _slow_consumer(self, why: str) -> None:
        self._end("cancelled", SlowConsumer(f"request {self.id!r} cancelled: {why}"), "send_timeout")

    @property
    def cancelled(self) -> bool:
        return self.state == "cancelled"

    # ------------------------------------------------------------------------------ iteration
    def _next(self) -> Any:
        """The next item for the caller, or _STOP at the end; raises the StageError of a failure."""
        try:
            item = self.channels[-1].get()
        except (Finished, Closed) as end:
            return self._stop(end)
        return self._took(item)

    async def _anext(self) -> Any:
        """`_next` for an asyncio caller: waits without holding a thread."""
        try:
            item = await self.channels[-1].aget()
        except (Finished, Closed) as end:
            return self._stop(end)
        return self._took(item)

    def _stop(self, end: Exception) -> Any:
        if isinstance(end, Finished):
            self._end("done")
            return _STOP
        if self.error is not None:
            raise self.error from getattr(self.error, "original", None)
        return _STOP

    def _took(self, item: Any) -> Any:
        if self.first_item_ms is None:
            now = time.perf_counter()
            self.first_item_ms = (now - self.submitted) * 1e3
            self.chain._first_items.append(self.first_item_ms)
            if self.started is not None:
                self.chain._lag_ms.append((now - self.started) * 1e3)
        return item

    def __iter__(self) -> Iterator[Any]:
        try:
            while (item := self._next()) is not _STOP:
                yield item
        finally:
            self.cancel()  # a no-op when done; frees the stages when the caller stops early

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while (item := await self._anext()) is not _STOP:
                yield item
        finally:
            self.cancel()

    def result(self) -> list[Any]:
        """Every item, in order (blocks until the end)."""
        return list(self)


class Chain:
    """Stages joined by bounded channels (module docstring). Workers start on the first `submit`."""

    def __init__(self, stages: Iterable[Stage], queue_size: int = 4, max_pending: int = 64,
                 send_timeout_s: float | None = None) -> None:
        self.stages = tuple(stages)
        names = [s.name for s in self.stages]
        if not self.stages or len(set(names)) != len(names):
            raise ConfigError(f"a chain needs at least one stage and unique stage names, got {names}")
        if queue_size <= 0 or max_pending <= 0:
            raise ConfigError(f"queue_size ({queue_size}) and max_pending ({max_pending}) must be positive")
        if send_timeout_s is not None and not send_timeout_s > 0:
            raise ConfigError(f"send_timeout_s ({send_timeout_s}) must be positive, or None for no limit")
        self.queue_size, self.max_pending = int(queue_size), int(max_pending)
        self.send_timeout_s = send_timeout_s
        self._jobs: list[queue.Queue] = [queue.PriorityQueue()] + [queue.Queue() for _ in self.stages[1:]]
        self._stats = {s.name: _StageStats() for s in self.stages}
        self._first_items: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self._queue_ms: deque[float] = deque(maxlen=KEEP_SAMPLES)  # submit -> the first stage takes it
        self._lag_ms: deque[float] = deque(maxlen=ESTIMATE_SAMPLES)  # start -> first item to the caller
        self._held_ms: deque[float] = deque(maxlen=ESTIMATE_SAMPLES)  # time a request held stage 0
        self._totals: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self._outcomes = {"done": 0, "failed": 0, "cancelled": 0, "send_timeout": 0}
        self._pending: set[Request] = set()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        if any(s.is_continuous for s in self.stages[1:]):
            raise ConfigError("a continuous stage must be the first stage of its chain")
        self._batched = {k: (ContinuousWorker if s.is_continuous else BatchedWorker)(self, k)
                         for k, s in enumerate(self.stages) if s.max_batch or s.is_continuous}
        self._closed = False

    # ------------------------------------------------------------------------------ requests
    def submit(self, payload: Any, priority: int = 0, request_id: str | None = None) -> Request:
        """Queue a request (served by priority, then in order); ChainFull when max_pending are held."""
        seq = next(self._seq)
        request = Request(self, payload, int(priority), request_id or f"req-{seq}", self.queue_size, seq)
        self._listen(request)
        with self._lock:
            if self._closed:
                raise ConfigError("the chain is closed")
            if len(self._pending) >= self.max_pending:
                raise ChainFull(f"{len(self._pending)} requests already queued or running "
                                f"(max_pending={self.max_pending}); retry later")
            self._pending.add(request)
            self._start_workers()
        self._push(0, (request.priority, seq, request))
        return request

    def stream(self, payload: Any, priority: int = 0) -> Iterator[Any]:
        """Submit and iterate: ``for item in chain.stream(x)``; stopping early cancels the request."""
        return iter(self.submit(payload, priority))

    def astream(self, payload: Any, priority: int = 0) -> AsyncIterator[Any]:
        """Submit and iterate asynchronously: ``async for item in chain.astream(x)``."""
        return self.submit(payload, priority).__aiter__()

    def _retire(self, request: Request) -> None:
        with self._lock:
            self._pending.discard(request)
            self._outcomes[request.state] += 1
            if request.reason is not None:
                self._outcomes[request.reason] += 1
            if request.total_ms is not None and request.state == "done":
                self._totals.append(request.total_ms)

    # ------------------------------------------------------------------------------ workers
    def _listen(self, request: Request) -> None:
        """A batched stage's worker is woken by its requests' input and output channels."""
        for k, worker in self._batched.items():
            request.channels[k].listeners.append(worker.notify)
            if k > 0:
                request.channels[k - 1].listeners.append(worker.notify)

    def _push(self, k: int, job: Any) -> None:
        self._jobs[k].put(job)
        if k in self._batched:
            self._batched[k].notify()

    def _forward(self, k: int, request: Request | None) -> None:
        """Hand a request (or the stop sentinel) to the stage after k, which consumes while k produces."""
        if k + 1 < len(self.stages):
            self._push(k + 1, request)

    def _start_workers(self) -> None:
        if self._threads:
            return
        wake = self._batched[0].notify if 0 in self._batched else None
        weakref.finalize(self, _stop_workers, self._jobs[0], self._threads, wake)  # at exit / collected
        for k, stage in enumerate(self.stages):
            target = self._batched[k].run if k in self._batched else partial(self._work, k)
            t = threading.Thread(target=target, name=f"flashrt-chain-{stage.name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self, k: int) -> None:
        while True:
            job = self._jobs[k].get()
            request = job[2] if k == 0 else job
            self._forward(k, request)
            if request is None:
                return
            if request.ended.is_set():
                continue
            if k == 0:
                request._mark_running()
            try:
                self._serve(k, request)
                if k == 0 and request.channels[0].finished:  # held to its end (not cut short)
                    self._held_ms.append((time.perf_counter() - request.started) * 1e3)
            except BaseException as exc:  # noqa: BLE001 - the worker outlives anything a stage does
                log.exception("chain stage %r: unexpected error serving %s", self.stages[k].name, request.id)
                request._end("failed", StageError(self.stages[k].name, request.id, exc))

    def _serve(self, k: int, request: Request) -> None:
        stage, stats = self.stages[k], self._stats[self.stages[k].name]
        out = request.channels[k]
        send_timeout_s = self.send_timeout_s if k == len(self.stages) - 1 else None
        source = _Input(request, k)
        produced = iter(())
        try:
            produced = iter(stage.fn(source, request))
            for item in _timed(produced, source, stats):
                out.put(item, send_timeout_s)
                stats.depth.append(out.depth)
                stats.max_depth = max(stats.max_depth, out.max_depth)
            out.finish()
        except (Closed, _Cancelled):
            pass
        except SendTimeout as exc:
            request._slow_consumer(str(exc))
        except BaseException as exc:  # noqa: BLE001 - any stage behaviour ends only its own request
            stats.failures += 1
            request._end("failed", StageError(stage.name, request.id, exc))
        finally:
            stats.blocked.append(out.put_wait_s * 1e3)
            _close_quietly(produced, stage.name, request)

    def close(self) -> None:
        """Cancel what is pending and stop the workers (idempotent)."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for request in pending:
            request.cancel()
        _stop_workers(self._jobs[0], self._threads, self._batched[0].notify if 0 in self._batched else None)

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ admission
    def estimate_first_item_ms(self) -> float | None:
        """When a request submitted now would give its first item, in ms (module docstring)."""
        first = self.stages[0]
        if first.max_batch or not self._held_ms or not self._lag_ms:
            return None
        held = sum(self._held_ms) / len(self._held_ms)
        lag = sum(self._lag_ms) / len(self._lag_ms)
        now = time.perf_counter()
        with self._lock:
            pending = list(self._pending)
        places = int(first.fn.capacity) if first.is_continuous else 1
        # when each place of the first stage frees up: running requests end after the mean hold,
        # queued ones (in order) take the earliest free place and hold it that long
        free_at = sorted(max(0.0, held - (now - r.started) * 1e3) for r in pending
                         if r.state == "running" and r.started is not None)[:places]
        free_at += [0.0] * (places - len(free_at))
        heapq.heapify(free_at)
        for _ in range(sum(r.state == "queued" for r in pending)):
            heapq.heappush(free_at, heapq.heappop(free_at) + held)
        return free_at[0] + lag

    # ------------------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Per stage: service ms per item, ms blocked by backpressure per request, output queue depth
        after each item (LatencyStats of counts), items, deepest queue;
        time to first item and total per request (from submit), time queued before the first stage;
        outcomes; requests now held, queued and running; the admission estimate for a request now."""
        with self._lock:
            states = [r.state for r in self._pending]
        return {"stages": {name: s.summary() for name, s in self._stats.items()},
                "first_item_ms": LatencyStats.from_samples(self._first_items).to_dict(),
                "total_ms": LatencyStats.from_samples(self._totals).to_dict(),
                "queue_ms": LatencyStats.from_samples(self._queue_ms).to_dict(),
                "outcomes": dict(self._outcomes), "pending": len(states),
                "queued": states.count("queued"), "running": states.count("running"),
                "estimate_first_item_ms": self.estimate_first_item_ms(),
                "queue_bound": self.queue_size}


def _stop_workers(first: queue.Queue, threads: list[threading.Thread],
                  wake: Callable[[], None] | None = None) -> None:
    """Send the stop sentinel down the stages once and join the workers (idempotent)."""
    if threads and any(t.is_alive() for t in threads):
        first.put((float("-inf"), -1, None))
        if wake is not None:
            wake()
        for t in threads:
            t.join(timeout=5)


def _close_quietly(produced: Any, stage: str, request: Request) -> None:
    """Close a stage's generator; whatever it does when closed (swallow ``GeneratorExit`` and yield
    again, raise) ends only its request."""
    close = getattr(produced, "close", None)
    if close is None:
        return
    try:
        close()
    except BaseException as exc:  # noqa: BLE001
        request._end("failed", StageError(stage, request.id, exc))


class _Input:
    """The items stage k reads: the payload (k = 0) or the previous stage's channel."""

    def __init__(self, request: Request, k: int) -> None:
        self.request, self.k = request, k
        self.wait_s = 0.0
        self._given = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.request.ended.is_set() and self.request.state != "done":
            raise _Cancelled
        if self.k == 0:
            if self._given:
                raise StopIteration
            self._given = True
            return self.request.payload
        channel = self.request.channels[self.k - 1]
        start = time.perf_counter()
        try:
            return channel.get()
        except Finished:
            raise StopIteration from None
        except Closed:
            raise _Cancelled from None
        finally:
            self.wait_s += time.perf_counter() - start


def _timed(produced: Iterator[Any], source: _Input, stats: _StageStats) -> Iterator[Any]:
    """Yield the stage's items, recording each one's service time (its input waits excluded)."""
    while True:
        start, waited = time.perf_counter(), source.wait_s
        try:
            item = next(produced)
        except StopIteration:
            return
        stats.service.append(((time.perf_counter() - start) - (source.wait_s - waited)) * 1e3)
        stats.items += 1
        yield item
