"""Batched chain stages (`Stage.batched`): items of several requests in one call, each output routed
back to its request; one request's slow consumer, cancel or error never touches its neighbours."""

import threading

import pytest

from flashrt.chain import Chain, SlowConsumer, Stage, StageError
from flashrt.errors import ConfigError

WAIT = 10.0  # guard against a hung test only


def _source(items, request):
    (payload,) = list(items)
    tag, n = payload
    for i in range(n):
        yield (tag, i)


class _Recorder:
    """A batched fn: (tag, i) -> f"{tag}:{10 * i}"; records each call's batch; the first call waits for
    `gate` so that later calls find several requests ready; raises on tag "bad"."""

    def __init__(self, gate=None):
        self.calls, self.gate = [], gate

    def __call__(self, items, requests):
        if self.gate is not None and not self.calls:
            self.gate.wait(WAIT)
        self.calls.append([tag for tag, _ in items])
        assert len(requests) == len(items)
        assert all(r.payload[0] == tag for r, (tag, _) in zip(requests, items))
        if any(tag == "bad" for tag, _ in items):
            raise RuntimeError("bad item")
        return [f"{tag}:{10 * i}" for tag, i in items]


def _within(fn):
    """fn() on a helper thread (its result, or its exception raised here); fails instead of hanging."""
    box = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT)
    assert box, f"did not return within {WAIT} s"
    ok, value = box[0]
    if not ok:
        raise value
    return value


def test_items_of_several_requests_share_calls_and_each_gets_its_own_outputs():
    gate = threading.Event()
    fn = _Recorder(gate)
    with Chain([Stage("source", _source), Stage.batched("scale", fn, max_batch=4)], queue_size=8) as chain:
        requests = [chain.submit((f"r{j}", 3)) for j in range(5)]
        for _ in range(1000):  # until the source has produced every item (the scale stage waits)
            if all(r.channels[0].finished for r in requests):
                break
            threading.Event().wait(0.01)
        gate.set()
        results = [_within(r.result) for r in requests]
        stats = chain.stats()["stages"]["scale"]
    assert results == [[f"r{j}:0", f"r{j}:10", f"r{j}:20"] for j in range(5)]
    assert max(len(c) for c in fn.calls) == 4 and all(len(set(c)) == len(c) for c in fn.calls)
    assert stats["items"] == 15 and stats["batch"]["max"] == 4 and stats["fill"]["max"] == 1.0


def test_a_batched_first_stage_takes_each_payload_once():
    def square(items, requests):
        return [x * x for x in items]

    with Chain([Stage.batched("square", square, max_batch=3)]) as chain:
        requests = [chain.submit(x) for x in range(7)]
        assert [_within(r.result) for r in requests] == [[x * x] for x in range(7)]


def test_slow_consumer_cancel_and_error_leave_the_batch_neighbours_exact():
    gate = threading.Event()
    fn = _Recorder(gate)
    stages = [Stage("source", _source), Stage.batched("scale", fn, max_batch=8)]
    with Chain(stages, queue_size=2, send_timeout_s=0.3) as chain:
        slow = chain.submit(("slow", 50))      # its caller never reads
        cancelled = chain.submit(("gone", 50))
        bad = chain.submit(("bad", 3))
        good = [chain.submit((f"ok{j}", 6)) for j in range(2)]
        gate.set()
        it = iter(cancelled)
        assert _within(lambda: next(it)) == "gone:0"
        cancelled.cancel()
        with pytest.raises(StageError) as err:
            _within(bad.result)
        assert err.value.stage == "scale" and isinstance(err.value.original, RuntimeError)
        assert [_within(r.result) for r in good] == [[f"ok{j}:{10 * i}" for i in range(6)] for j in range(2)]
        assert slow.ended.wait(WAIT) and slow.reason == "send_timeout"
        with pytest.raises(SlowConsumer):
            list(slow)
        outcomes = chain.stats()["outcomes"]
    assert outcomes == {"done": 2, "failed": 1, "cancelled": 2, "send_timeout": 1}


def test_a_failing_call_is_retried_item_by_item_so_only_the_bad_item_fails():
    from flashrt.chain.batched import _call

    fn = _Recorder()

    class _Req:
        def __init__(self, tag):
            self.payload = (tag, 0)

    batch = [(_Req(tag), (tag, i)) for i, tag in enumerate(["a", "bad", "c"])]
    results = _call(fn, batch)
    assert [ok for ok, _ in results] == [True, False, True]
    assert results[0][1] == "a:0" and results[2][1] == "c:20" and isinstance(results[1][1], RuntimeError)
    assert fn.calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


def test_max_batch_must_be_positive():
    with pytest.raises(ConfigError, match="max_batch"):
        Stage.batched("x", lambda items, requests: items, max_batch=0)
