"""The worker of a batched chain stage: one call serves items of several requests at once.

    Stage.batched("snac", decode_windows, max_batch=8)   # decode_windows(items, requests) -> outputs

A batched stage maps items one to one: ``fn(items, requests)`` gets up to ``max_batch`` items, each
from a different request (its ``requests[i]``), and returns one output per item, in order; an output
of None sends nothing on (an item that completes no output yet, e.g. a codec window still filling). The worker
watches every request that reached its stage (through the channels' listeners, holding no lock of
theirs while it computes) and gathers, in priority then submission order, one ready item from each
request whose output channel has room: a request whose consumer is slow is simply not picked (its
channel is full), so it stalls only itself, never the others in a batch. When the chain has a
``send_timeout_s`` and this is the last stage, such a request is cancelled once its consumer has
taken nothing for that long.

Errors: when a batched call raises, each of its items is run alone; the items that fail alone end
their own request with a `StageError` (the original exception attached), the others get their output
as usual. So an error of one request never fails its neighbours, provided ``fn`` gives each item the
same output alone as in a batch (the contract of any batched stage: tests check it per family).

Per-stage statistics add the batch size of each call and its fill ratio (size / ``max_batch``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flashrt.chain.channel import Closed, Finished

if TYPE_CHECKING:
    from flashrt.chain.chain import Chain, Request

__all__ = ["BatchedWorker", "send_deadline", "cut_if_stalled", "idle_timeout"]


class BatchedWorker:
    """Serves stage ``k`` of ``chain`` (a `Stage.batched`), on the thread that calls `run`."""

    def __init__(self, chain: Chain, k: int) -> None:
        self.chain, self.k = chain, k
        self.stage = chain.stages[k]
        self.wake = threading.Event()
        self.active: list[Request] = []
        self._given: set[int] = set()  # ids of requests whose payload a first stage has taken
        self._stopping = False

    def notify(self) -> None:
        self.wake.set()

    def run(self) -> None:
        while True:
            self.wake.clear()
            self._admit()
            if self._stopping:
                return
            batch = self._gather()
            if batch:
                self._serve(batch)
            else:
                self.wake.wait(self._idle_timeout())

    # ------------------------------------------------------------------------------ requests
    def _admit(self) -> None:
        """Take the requests that reached this stage; hand each on to the next stage at once."""
        jobs = self.chain._jobs[self.k]
        while not jobs.empty():
            job = jobs.get_nowait()
            request = job[2] if self.k == 0 else job
            self.chain._forward(self.k, request)
            if request is None:
                self._stopping = True
                return
            if self.k == 0:
                request._mark_running()
            self.active.append(request)
        self.active.sort(key=lambda r: (r.priority, r.seq))

    def _gather(self) -> list[tuple[Request, Any]]:
        """One ready item from each request that can take an output, up to max_batch."""
        batch: list[tuple[Request, Any]] = []
        for request in list(self.active):
            if len(batch) >= self.stage.max_batch:
                break
            out = request.channels[self.k]
            if request.ended.is_set() and request.state != "done" or out.closed:
                self._drop(request)
                continue
            if out.full:
                self._check_stalled(request)
                continue
            got, item = self._take(request)
            if got:
                batch.append((request, item))
        return batch

    def _take(self, request: Request) -> tuple[bool, Any]:
        out = request.channels[self.k]
        if self.k == 0:
            if request.seq in self._given:
                out.finish()
                self._drop(request)
                return False, None
            self._given.add(request.seq)
            return True, request.payload
        try:
            return request.channels[self.k - 1].try_get()
        except Finished:
            out.finish()
        except Closed:
            pass
        self._drop(request)
        return False, None

    def _drop(self, request: Request) -> None:
        self.active.remove(request)
        self._given.discard(request.seq)

    def _check_stalled(self, request: Request) -> None:
        if cut_if_stalled(self.chain, self.k, request):
            self._drop(request)

    def _idle_timeout(self) -> float | None:
        return idle_timeout(self.chain, self.k, self.active)

    # ------------------------------------------------------------------------------ calls
    def _serve(self, batch: list[tuple[Request, Any]]) -> None:
        stats = self.chain._stats[self.stage.name]
        start = time.perf_counter()
        results = _call(self.stage.fn, batch)
        per_item = (time.perf_counter() - start) * 1e3 / len(batch)
        stats.record_batch(len(batch), self.stage.max_batch)
        for (request, _), (ok, value) in zip(batch, results):
            if not ok:
                stats.failures += 1
                request._fail(self.stage.name, value)
                continue
            out = request.channels[self.k]
            if value is None:
                stats.items += 1
                continue
            try:
                out.put(value)  # never blocks: only this worker puts, and the channel had room
            except Closed:
                continue
            stats.service.append(per_item)
            stats.items += 1
            stats.depth.append(out.depth)
            stats.max_depth = max(stats.max_depth, out.max_depth)


def send_deadline(chain: Chain, k: int) -> float | None:
    """The chain's send deadline when stage ``k`` feeds the caller (the last stage), else None."""
    timeout = chain.send_timeout_s
    return timeout if timeout is not None and k == len(chain.stages) - 1 else None


def cut_if_stalled(chain: Chain, k: int, request: Request) -> bool:
    """Cancel ``request`` as a slow consumer when its caller took nothing for the send deadline."""
    timeout = send_deadline(chain, k)
    if timeout is None or request.channels[k].stalled_s() < timeout:
        return False
    request._slow_consumer(f"the consumer took nothing for {timeout:g} s")
    return True


def idle_timeout(chain: Chain, k: int, requests: list[Request]) -> float | None:
    """How long a stage worker with nothing to run may sleep: until the next send deadline of a request
    whose channel is full, or until woken (None)."""
    timeout = send_deadline(chain, k)
    if timeout is None:
        return None
    left = [timeout - r.channels[k].stalled_s() for r in requests if r.channels[k].full]
    return max(0.0, min(left)) + 1e-3 if left else None


def _call(fn: Callable[[list[Any], list[Any]], Any], batch: list[tuple[Any, Any]]) -> list[tuple[bool, Any]]:
    """[(ok, output or exception)] of ``fn`` over the batch; on a failed call, each item alone."""
    requests, items = [r for r, _ in batch], [i for _, i in batch]
    try:
        outputs = list(fn(items, requests))
        if len(outputs) != len(items):
            raise ValueError(f"a batched stage returned {len(outputs)} outputs for {len(items)} items")
        return [(True, out) for out in outputs]
    except BaseException:  # noqa: BLE001 - find the item(s) at fault, alone
        if len(batch) == 1:
            return [_alone(fn, batch[0])]
        return [_alone(fn, one) for one in batch]


def _alone(fn: Callable[[list[Any], list[Any]], Any], one: tuple[Any, Any]) -> tuple[bool, Any]:
    request, item = one
    try:
        outputs = list(fn([item], [request]))
        if len(outputs) != 1:
            raise ValueError(f"a batched stage returned {len(outputs)} outputs for 1 item")
        return True, outputs[0]
    except BaseException as exc:  # noqa: BLE001 - ends only this item's request
        return False, exc
