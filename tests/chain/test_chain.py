"""The local chain: streaming, backpressure, cancel, errors naming the stage, concurrency, priority."""

import asyncio
import threading

import pytest

from flashrt.chain import Chain, ChainFull, SlowConsumer, Stage, StageError

WAIT = 10.0  # seconds; only a guard against a hung test, never a timing assertion


def _within(fn):
    """fn() on a helper thread; fails (instead of hanging the suite) when it has not returned in WAIT."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(WAIT)
    assert box, f"did not return within {WAIT} s"
    return box[0]


def _count(n_items, log=None):
    def source(items, request):
        (n,) = list(items)
        try:
            for i in range(n):
                if log is not None:
                    log.append(i)
                yield i
        finally:
            if log is not None:
                log.append("closed")
    return Stage("count", source)


def _three(log=None, middle=lambda x: x * 10):
    return Chain([_count(None, log), Stage.map("scale", middle), Stage.map("label", lambda x: f"#{x}")],
                 queue_size=2)


def test_items_stream_through_every_stage_in_order():
    with _three() as chain:
        assert list(chain.stream(5)) == ["#0", "#10", "#20", "#30", "#40"]
        stats = chain.stats()
    assert stats["outcomes"]["done"] == 1 and stats["stages"]["scale"]["items"] == 5
    assert stats["first_item_ms"]["count"] == 1 and stats["stages"]["count"]["service_ms"]["count"] == 5


def test_a_slow_consumer_keeps_every_queue_within_its_bound():
    produced = []
    with _three(produced) as chain:
        request = chain.submit(200)
        seen = 0
        for _ in request:
            seen += 1
            # everything produced but not consumed sits in 3 channels of 2 items, plus one item per stage
            assert len(produced) - seen <= 3 * 2 + 3
            assert all(ch.depth <= 2 for ch in request.channels)
        assert seen == 200
        stages = chain.stats()["stages"].values()
        assert max(s["max_queue_depth"] for s in stages) <= 2
        assert all(s["queue_depth"]["max"] <= 2 and s["queue_depth"]["count"] == 200 for s in stages)


def test_cancel_mid_stream_stops_every_stage_and_the_next_request_runs():
    log = []
    with _three(log) as chain:
        request = chain.submit(10_000)
        it = iter(request)
        assert [next(it) for _ in range(3)] == ["#0", "#10", "#20"]
        request.cancel()
        assert request.ended.wait(WAIT) and request.state == "cancelled"
        assert list(it) == []
        for _ in range(100):  # the producer's generator is closed (its finally ran) within one item
            if "closed" in log:
                break
            threading.Event().wait(0.05)
        assert "closed" in log and len(log) < 20
        assert list(chain.stream(3)) == ["#0", "#10", "#20"]


def test_breaking_out_of_the_loop_cancels_the_request():
    with _three() as chain:
        request = chain.submit(10_000)
        for item in request:
            if item == "#20":
                break
        assert request.state == "cancelled"
        assert chain.stats()["pending"] == 0


def test_an_error_in_the_middle_stage_names_it_and_the_next_request_is_fine():
    def middle(x):
        if x == 3:
            raise ZeroDivisionError("boom at 3")
        return x * 10

    with _three(middle=middle) as chain:
        request = chain.submit(6)
        with pytest.raises(StageError, match="'scale'") as err:
            list(request)
        assert err.value.stage == "scale" and isinstance(err.value.original, ZeroDivisionError)
        assert isinstance(err.value.__cause__, ZeroDivisionError) and request.state == "failed"
        assert list(chain.stream(3)) == ["#0", "#10", "#20"]
        assert chain.stats()["outcomes"] == {"done": 1, "failed": 1, "cancelled": 0, "send_timeout": 0}


def test_eight_concurrent_requests_all_complete_correctly():
    results = {}
    with _three() as chain:
        def client(n):
            results[n] = list(chain.stream(n))
        threads = [threading.Thread(target=client, args=(n,)) for n in range(3, 11)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
    assert results == {n: [f"#{10 * i}" for i in range(n)] for n in range(3, 11)}


def test_priority_serves_urgent_requests_first_and_capacity_is_bounded():
    gate, started, order = threading.Event(), threading.Event(), []

    def first(items, request):
        (n,) = list(items)
        if n == "block":
            started.set()
            gate.wait(WAIT)
        order.append(n)
        yield n

    with Chain([Stage("first", first)], max_pending=3) as chain:
        blocker = chain.submit("block")
        assert started.wait(WAIT)
        late, urgent = chain.submit("late", priority=5), chain.submit("urgent", priority=-5)
        with pytest.raises(ChainFull):
            chain.submit("one too many")
        gate.set()
        for request in (blocker, late, urgent):
            request.result()
    assert order == ["block", "urgent", "late"]


def test_async_iteration():
    async def collect(chain):
        return [item async for item in chain.astream(4)]

    with _three() as chain:
        assert asyncio.run(collect(chain)) == ["#0", "#10", "#20", "#30"]


def test_async_waiters_hold_no_thread_more_requests_than_executor_threads():
    """Many async consumers of multi-item requests, one executor thread: a waiting request must not
    park a thread (the running request's consumer would never get one and the chain would wedge)."""
    from concurrent.futures import ThreadPoolExecutor

    async def collect(chain, n):
        return [item async for item in chain.astream(n)]

    async def main(chain):
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        jobs = [collect(chain, n) for n in range(10, 22)]
        return await asyncio.wait_for(asyncio.gather(*jobs), WAIT)

    with _three() as chain:
        results = asyncio.run(main(chain))
    assert results == [[f"#{10 * i}" for i in range(n)] for n in range(10, 22)]


def test_a_consumer_that_stops_reading_is_cancelled_after_the_send_timeout_and_frees_the_stage():
    with Chain([_count(None)], queue_size=2, send_timeout_s=0.2) as chain:
        stuck = chain.submit(1000)          # its caller never reads
        after = chain.submit(5)
        assert _within(lambda: list(after)) == [0, 1, 2, 3, 4] and after.state == "done"
        assert stuck.ended.wait(WAIT) and stuck.state == "cancelled" and stuck.reason == "send_timeout"
        with pytest.raises(SlowConsumer):
            list(stuck)
        assert chain.stats()["outcomes"]["send_timeout"] == 1
        assert chain.stats()["pending"] == 0


def test_a_slow_but_steady_consumer_never_trips_the_send_timeout():
    with Chain([_count(None)], queue_size=1, send_timeout_s=0.15) as chain:
        got = []
        for item in chain.submit(6):
            got.append(item)
            threading.Event().wait(0.05)  # slower than the producer, well inside the timeout
        assert got == list(range(6))


@pytest.mark.parametrize("kind", ["system_exit", "keyboard_interrupt", "swallows_generator_exit"])
def test_any_stage_behaviour_ends_only_its_request_and_the_worker_lives(kind):
    def hostile(items, request):
        (n,) = list(items)
        if n == "bad" and kind == "system_exit":
            raise SystemExit(3)
        if n == "bad" and kind == "keyboard_interrupt":
            raise KeyboardInterrupt
        for i in range(1000 if n == "bad" else n):
            try:
                yield i
            except GeneratorExit:
                if n == "bad":
                    yield "still here"  # close() raises RuntimeError: the generator ignored GeneratorExit

    with Chain([Stage("hostile", hostile)], queue_size=2) as chain:
        bad = chain.submit("bad")
        if kind == "swallows_generator_exit":
            it = iter(bad)
            assert next(it) == 0
            bad.cancel()
        else:
            with pytest.raises(StageError) as err:
                list(bad)
            assert isinstance(err.value.original, SystemExit | KeyboardInterrupt)
        assert bad.ended.wait(WAIT)
        assert _within(lambda: list(chain.stream(3))) == [0, 1, 2]
        assert all(t.is_alive() for t in chain._threads)
