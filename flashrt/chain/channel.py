"""A bounded, closable channel between two chain stages (one producer thread, one consumer thread).

`put` blocks while the channel holds ``bound`` items (backpressure: a fast producer waits for its
consumer, memory stays bounded); `get` blocks while it is empty. Both wake at once when the channel
is closed (cancel, or an error elsewhere in the request) and then raise `Closed`, so a cancelled
request frees a blocked stage within one item, without polling. `finish()` marks the normal end: the
consumer drains what is left, then `get` raises `StopIteration`'s stand-in `Finished`.

``max_depth`` is the largest number of items ever held (tests pin it at or under ``bound``);
``put_wait_s`` / ``get_wait_s`` the time spent blocked on each side.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

__all__ = ["Channel", "Closed", "Finished"]


class Closed(Exception):
    """The channel was closed (the request was cancelled or failed)."""


class Finished(Exception):
    """The producer finished and every item was taken."""


class Channel:
    """Bounded FIFO of items for one request between two stages (module docstring)."""

    def __init__(self, bound: int) -> None:
        if bound <= 0:
            raise ValueError(f"channel bound must be positive, got {bound}")
        self.bound = int(bound)
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = self._finished = False
        self.max_depth = 0
        self.put_wait_s = self.get_wait_s = 0.0

    def put(self, item: Any) -> None:
        with self._cond:
            start = time.perf_counter()
            while len(self._items) >= self.bound and not self._closed:
                self._cond.wait()
            self.put_wait_s += time.perf_counter() - start
            if self._closed:
                raise Closed
            self._items.append(item)
            self.max_depth = max(self.max_depth, len(self._items))
            self._cond.notify_all()

    def get(self) -> Any:
        with self._cond:
            start = time.perf_counter()
            while not self._items and not self._closed and not self._finished:
                self._cond.wait()
            self.get_wait_s += time.perf_counter() - start
            if self._closed:
                raise Closed
            if not self._items:
                raise Finished
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; later puts and gets raise `Closed`; held items are dropped."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed
