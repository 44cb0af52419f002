"""A bounded, closable channel between two chain stages (one producer thread, one consumer).

`put` blocks while the channel holds ``bound`` items (backpressure: a fast producer waits for its
consumer, memory stays bounded); `get` blocks while it is empty. Both wake at once when the channel
is closed (cancel, or an error elsewhere in the request) and then raise `Closed`, so a cancelled
request frees a blocked stage within one item, without polling. `finish()` marks the normal end: the
consumer drains what is left, then `get` raises `StopIteration`'s stand-in `Finished`.

The consumer may be a thread (`get`) or an asyncio task (`aget`): an async consumer waits on a future
of its own loop, woken from the producer's thread with ``call_soon_threadsafe``, so a waiting request
holds no thread (a server with many requests parked on their channels never exhausts an executor).

``put(item, send_timeout_s=...)`` gives up with `SendTimeout` when the consumer has taken nothing for
that long while the channel stayed full (a client that stopped reading): the clock starts when the
channel fills and restarts at every `get`, so a slow but steady consumer never trips it.

``listeners`` are called (outside the lock, from whichever thread changed it) after every put, get,
finish and close: a batched stage's worker watches many requests' channels through them
(`flashrt.chain.batched`), with `try_get` to take an item without blocking.

``max_depth`` is the largest number of items ever held (tests pin it at or under ``bound``);
``put_wait_s`` / ``get_wait_s`` the time spent blocked on each side.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Channel", "Closed", "Finished", "SendTimeout"]


class Closed(Exception):
    """The channel was closed (the request was cancelled or failed)."""


class Finished(Exception):
    """The producer finished and every item was taken."""


class SendTimeout(Exception):
    """`put` waited longer than its send timeout for a consumer that took nothing."""


class Channel:
    """Bounded FIFO of items for one request between two stages (module docstring)."""

    def __init__(self, bound: int) -> None:
        if bound <= 0:
            raise ValueError(f"channel bound must be positive, got {bound}")
        self.bound = int(bound)
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = self._finished = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.listeners: list[Callable[[], None]] = []
        self._since = time.monotonic()  # the later of the last get and the moment the channel filled
        self.max_depth = 0
        self.put_wait_s = self.get_wait_s = 0.0

    # ------------------------------------------------------------------------------ producer
    def put(self, item: Any, send_timeout_s: float | None = None) -> None:
        with self._cond:
            start = time.perf_counter()
            try:
                while len(self._items) >= self.bound and not self._closed:
                    self._cond.wait(self._wait_left(send_timeout_s))
            finally:
                self.put_wait_s += time.perf_counter() - start
            if self._closed:
                raise Closed
            self._items.append(item)
            if len(self._items) >= self.bound:
                self._since = time.monotonic()
            self.max_depth = max(self.max_depth, len(self._items))
            self._wake()
        self._tell()

    def _wait_left(self, send_timeout_s: float | None) -> float | None:
        """Seconds a full channel's producer may still wait; SendTimeout when none are left."""
        if send_timeout_s is None:
            return None
        left = send_timeout_s - (time.monotonic() - self._since)
        if left <= 0:
            raise SendTimeout(f"the consumer took nothing for {send_timeout_s:g} s")
        return left

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._wake()
        self._tell()

    def close(self) -> None:
        """Wake every waiter; later puts and gets raise `Closed`; held items are dropped."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._wake()
        self._tell()

    # ------------------------------------------------------------------------------ consumer
    def get(self) -> Any:
        with self._cond:
            start = time.perf_counter()
            while not self._items and not self._closed and not self._finished:
                self._cond.wait()
            self.get_wait_s += time.perf_counter() - start
            item = self._take()
        self._tell()
        return item

    def try_get(self) -> tuple[bool, Any]:
        """(True, item) when one is held, (False, None) when none is yet; Closed / Finished at the end."""
        with self._cond:
            if not self._items and not self._closed and not self._finished:
                return False, None
            item = self._take()
        self._tell()
        return True, item

    async def aget(self) -> Any:
        """`get` for an asyncio consumer: waits on a future, holding no thread."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            while True:
                with self._cond:
                    if self._items or self._closed or self._finished:
                        item = self._take()
                        break
                    waiter = (loop, loop.create_future())
                    self._waiters.append(waiter)
                try:
                    await waiter[1]
                finally:
                    with self._cond:
                        if waiter in self._waiters:
                            self._waiters.remove(waiter)
        finally:
            self.get_wait_s += time.perf_counter() - start
        self._tell()
        return item

    def _take(self) -> Any:
        """Under the lock: the next item, or Closed / Finished."""
        if self._closed:
            raise Closed
        if not self._items:
            raise Finished
        item = self._items.popleft()
        self._since = time.monotonic()
        self._wake()
        return item

    def _wake(self) -> None:
        """Under the lock: wake blocked threads and every async waiter (each re-checks the state)."""
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: its waiter is gone with it
                loop.call_soon_threadsafe(_resolve, future)

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()

    def stalled_s(self) -> float:
        """Seconds the channel has been full with nothing taken (0 when it has room)."""
        return time.monotonic() - self._since if len(self._items) >= self.bound else 0.0

    @property
    def full(self) -> bool:
        return len(self._items) >= self.bound

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def closed(self) -> bool:
        return self._closed


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
