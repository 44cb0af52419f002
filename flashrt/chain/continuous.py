"""The worker of a continuous first stage: requests join and leave a running engine between its steps.

    Stage.continuous("lm", engine)      # engine: join / leave / pause / step (the `Engine` protocol)

An autoregressive stage serves many requests at once by stepping all of them together (one captured
decode step for every live sequence, `flashrt.runtime.slots.SlotDecoder`). Its requests do not come
and go with the items of a call: a request joins the engine when a place is free (up to
``engine.capacity``, in priority then submission order), gets output items from each step, and leaves
when it is done, cancelled, or failed.

The worker, one thread, loops: take the requests that reached the stage (handing each on to the next
stage at once) -> drop those that ended (``engine.leave``) -> join waiting requests while there is
room (``engine.join(request, payload)``; an exception ends only that request) -> pause the requests
whose output channel is full (``engine.pause(request, True)``: a slow consumer stalls only itself;
with the chain's ``send_timeout_s`` on a last stage it is cancelled after that long) -> one
``engine.step()`` -> route what it returns. Each step returns `Emit` records: at most one output item
per request (None: nothing this step), whether the request is done, or an exception that ends only
that request. An exception out of ``step`` itself ends every request in the engine (each leaves it);
the worker and the next requests go on.

Statistics: per step, the running requests (batch) and their share of the capacity (fill); now: the
requests live in the engine, waiting for a place, paused (`counts`); service time per item; time
queued before joining (the chain's ``queue_ms``); time each request held the stage (the admission
estimate, `Chain.estimate_first_item_ms`, simulates the places freeing up).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flashrt.chain.batched import cut_if_stalled, idle_timeout
from flashrt.chain.channel import Closed

if TYPE_CHECKING:
    from flashrt.chain.chain import Chain, Request

__all__ = ["Engine", "Emit", "ContinuousWorker"]


@dataclass
class Emit:
    """What one engine step gave one request: an output item (None: none), done, or an error."""

    request: Any
    item: Any = None
    done: bool = False
    error: BaseException | None = None


@runtime_checkable
class Engine(Protocol):
    """A stepping engine for `Stage.continuous` (module docstring)."""

    capacity: int

    def join(self, request: Request, payload: Any) -> None: ...

    def leave(self, request: Request) -> None: ...

    def pause(self, request: Request, paused: bool) -> None: ...

    def step(self) -> Iterable[Emit]: ...


class ContinuousWorker:
    """Serves stage 0 of ``chain`` (a `Stage.continuous`) on the thread that calls `run`."""

    def __init__(self, chain: Chain, k: int) -> None:
        self.chain, self.k = chain, k
        self.stage = chain.stages[k]
        self.engine: Engine = self.stage.fn
        self.wake = threading.Event()
        self.waiting: list[Request] = []
        self.live: list[Request] = []
        self.held: dict[Request, deque] = {}  # items a step gave a request whose channel filled meanwhile
        self._stopping = False
        chain._stats[self.stage.name].extra = self.counts

    def counts(self) -> dict[str, Any]:
        """Now: requests in the engine (``live``), waiting for a place, paused by a full channel."""
        live = list(self.live)
        return {"capacity": int(self.engine.capacity), "live": len(live), "waiting": len(self.waiting),
                "paused": sum(1 for r in live if r.channels[self.k].full or r in self.held)}

    def notify(self) -> None:
        self.wake.set()

    def run(self) -> None:
        while True:
            self.wake.clear()
            self._admit()
            if self._stopping:
                for request in list(self.live):
                    self._leave(request)
                return
            self._drop_ended()
            self._join()
            if self._flush_and_pause():
                self._step()
            else:
                self.wake.wait(self._idle_timeout())

    # ------------------------------------------------------------------------------ requests
    def _admit(self) -> None:
        jobs = self.chain._jobs[self.k]
        while not jobs.empty():
            request = jobs.get_nowait()[2]
            self.chain._forward(self.k, request)
            if request is None:
                self._stopping = True
                return
            self.waiting.append(request)
        self.waiting.sort(key=lambda r: (r.priority, r.seq))

    def _gone(self, request: Request) -> bool:
        return request.ended.is_set() and request.state != "done" or request.channels[self.k].closed

    def _drop_ended(self) -> None:
        self.waiting = [r for r in self.waiting if not self._gone(r)]
        for request in [r for r in self.live if self._gone(r)]:
            self._leave(request)

    def _leave(self, request: Request) -> None:
        self.live.remove(request)
        self.held.pop(request, None)
        try:
            self.engine.leave(request)
        except BaseException as exc:  # noqa: BLE001 - ends only this request
            request._fail(self.stage.name, exc)

    def _join(self) -> None:
        while self.waiting and len(self.live) < self.engine.capacity:
            request = self.waiting.pop(0)
            request._mark_running()
            try:
                self.engine.join(request, request.payload)
            except BaseException as exc:  # noqa: BLE001 - a bad request ends only itself
                self.chain._stats[self.stage.name].failures += 1
                request._fail(self.stage.name, exc)
                continue
            self.live.append(request)

    def _flush_and_pause(self) -> bool:
        """Deliver held items where there is room; pause the requests whose channel is full. True when
        some request can run a step."""
        running = False
        for request in list(self.live):
            out, held = request.channels[self.k], self.held.get(request)
            while held and not out.full:
                self._put(request, held.popleft())
            if held is not None and not held:
                self.held.pop(request)
                if getattr(held, "done", False):
                    self._done(request)
                    continue
            blocked = out.full or request in self.held
            self.engine.pause(request, blocked)
            if blocked:
                self._check_stalled(request)
            running = running or not blocked
        return running

    def _check_stalled(self, request: Request) -> None:
        if request in self.live and cut_if_stalled(self.chain, self.k, request):
            self._leave(request)

    def _idle_timeout(self) -> float | None:
        return idle_timeout(self.chain, self.k, self.live)

    # ------------------------------------------------------------------------------ steps
    def _step(self) -> None:
        stats = self.chain._stats[self.stage.name]
        running = sum(1 for r in self.live if not r.channels[self.k].full and r not in self.held)
        start = time.perf_counter()
        try:
            emits = list(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - the engine's state is unknown: end its requests
            stats.failures += len(self.live)
            for request in list(self.live):
                request._fail(self.stage.name, exc)
                self._leave(request)
            return
        items = sum(1 for e in emits if e.item is not None)
        stats.record_batch(running, self.engine.capacity)
        per_item = (time.perf_counter() - start) * 1e3 / max(items, 1)
        for emit in emits:
            self._route(emit, per_item)

    def _route(self, emit: Emit, per_item: float) -> None:
        request, stats = emit.request, self.chain._stats[self.stage.name]
        if request not in self.live:
            return
        if emit.error is not None:
            stats.failures += 1
            request._fail(self.stage.name, emit.error)
            self._leave(request)
            return
        if emit.item is not None:
            stats.service.append(per_item)
            if request.channels[self.k].full or request in self.held:
                self.held.setdefault(request, _Held()).append(emit.item)
            else:
                self._put(request, emit.item)
        if emit.done:
            if request in self.held:
                self.held[request].done = True
            else:
                self._done(request)

    def _put(self, request: Request, item: Any) -> None:
        out, stats = request.channels[self.k], self.chain._stats[self.stage.name]
        try:
            out.put(item)  # never blocks: only this worker puts, and the channel had room
        except Closed:
            return
        stats.items += 1
        stats.depth.append(out.depth)
        stats.max_depth = max(stats.max_depth, out.max_depth)

    def _done(self, request: Request) -> None:
        request.channels[self.k].finish()
        if request in self.live:
            self.live.remove(request)
        if request.started is not None:
            self.chain._held_ms.append((time.perf_counter() - request.started) * 1e3)


class _Held(deque):
    """Items waiting for room in a request's channel; ``done``: the request ends after them."""

    done = False
