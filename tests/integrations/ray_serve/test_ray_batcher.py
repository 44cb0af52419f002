"""`Batcher` (no Ray needed): the items waiting while the worker runs go together in the next run (up to
``max_batch``), each gets its own result or exception, an item whose caller went away is not run."""

import asyncio
import threading

import pytest

from flashrt.integrations.ray_serve.batcher import Batcher

pytestmark = pytest.mark.timeout(30)


def _blocking_run(gate: threading.Event, seen: list):
    def run(items):
        seen.append(list(items))
        gate.wait(10)
        return [ValueError(f"bad {i}") if i < 0 else 2 * i for i in items]

    return run


def test_waiting_items_run_together_up_to_max_batch_each_with_its_own_result():
    async def main():
        gate, seen = threading.Event(), []
        batcher = Batcher(_blocking_run(gate, seen), max_batch=2, name="t")
        first = asyncio.ensure_future(batcher(1))  # runs alone, holds the worker until the gate opens
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher(i)) for i in (2, -3, 4)]
        await asyncio.sleep(0.05)
        gate.set()
        assert await first == 2
        results = await asyncio.gather(*rest, return_exceptions=True)
        assert results[0] == 4 and isinstance(results[1], ValueError) and results[2] == 8
        assert seen == [[1], [2, -3], [4]] and batcher.rounds == {1: 2, 2: 1}

    asyncio.run(asyncio.wait_for(main(), 20))


def test_an_item_whose_caller_went_away_is_not_run():
    async def main():
        gate, seen = threading.Event(), []
        batcher = Batcher(_blocking_run(gate, seen), max_batch=None, name="t")
        first = asyncio.ensure_future(batcher(1))
        await asyncio.sleep(0.05)
        gone, kept = asyncio.ensure_future(batcher(5)), asyncio.ensure_future(batcher(6))
        await asyncio.sleep(0.05)
        gone.cancel()
        gate.set()
        assert await first == 2 and await kept == 12
        assert seen == [[1], [6]]
        batcher.worker.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            batcher.check_health()

    asyncio.run(asyncio.wait_for(main(), 20))
