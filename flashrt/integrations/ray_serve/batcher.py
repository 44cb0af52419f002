"""`Batcher`: the items waiting for a replica's one worker thread, run together when it comes free."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["Batcher"]


class Batcher:
    """Items submitted on a replica's event loop (`__call__`) wait for its one worker thread; when the
    worker comes free, the items waiting then (up to ``max_batch``; None: all) run as one
    ``run(items)`` call, which returns each item's result or the exception that ended it, in order.
    Nothing waits for more items (no latency is added); an item whose caller went away is dropped before
    the run. ``rounds`` counts items per run."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], max_batch: int | None, name: str) -> None:
        self.run, self.max_batch = run, max_batch
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=name)  # one run at a time
        self.waiting: list[tuple[Any, asyncio.Future]] = []
        self.drainer: asyncio.Task | None = None
        self.rounds: Counter[int] = Counter()

    async def __call__(self, item: Any) -> Any:
        """``item``'s result (its exception raised), run with the other items waiting for the worker."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((item, future))
        if self.drainer is None or self.drainer.done():
            self.drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            live = [entry for entry in self.waiting if not entry[1].done()]
            cut = len(live) if self.max_batch is None else self.max_batch
            taken, self.waiting = live[:cut], live[cut:]
            if not taken:
                continue
            self.rounds[len(taken)] += 1
            try:
                outs = await loop.run_in_executor(self.worker, self.run, [item for item, _ in taken])
            except BaseException as exc:  # the worker gone (replica shutting down): every item says so
                outs = [exc] * len(taken)
            for (_, future), out in zip(taken, outs):
                if not future.done():
                    future.set_exception(out) if isinstance(out, BaseException) else future.set_result(out)

    def check_health(self) -> None:
        if self.worker._shutdown:
            raise RuntimeError(f"the {self.worker._thread_name_prefix} worker is shut down")
