"""Continuous chain stages (`Stage.continuous`): requests join a stepping engine while it has room and
leave when done; one request's slow consumer, cancel or error never touches the others; the admission
estimate counts the engine's places."""

import threading
import time

import pytest

from flashrt.chain import Chain, SlowConsumer, Stage, StageError
from flashrt.chain.continuous import Emit
from flashrt.errors import ConfigError

WAIT = 10.0  # guard against a hung test only


class Counter:
    """An engine: payload (tag, n) -> items f"{tag}:{i}" for i < n, one per step per running request;
    records the running tags of each step; tag "bad" fails at its third item, "boom" breaks a step."""

    def __init__(self, capacity=3):
        self.capacity = capacity
        self.live, self.paused, self.steps, self.joined = {}, set(), [], []
        self.lock = threading.Lock()

    def join(self, request, payload):
        tag, n = payload
        if tag == "refuse":
            raise ValueError("refused at join")
        assert len(self.live) < self.capacity
        self.live[request] = [tag, n, 0]
        self.joined.append(tag)

    def leave(self, request):
        self.live.pop(request, None)
        self.paused.discard(request)

    def pause(self, request, paused):
        (self.paused.add if paused else self.paused.discard)(request)

    def step(self):
        running = [r for r in self.live if r not in self.paused]
        self.steps.append(sorted(self.live[r][0] for r in running))
        if any(self.live[r][0] == "boom" for r in running):
            raise RuntimeError("the engine broke")
        emits = []
        for request in running:
            state = self.live[request]
            tag, n, i = state
            if tag == "bad" and i == 2:
                emits.append(Emit(request, error=ValueError("bad item")))
                self.live.pop(request)
                continue
            state[2] += 1
            done = state[2] == n
            if done:
                self.live.pop(request)
            emits.append(Emit(request, f"{tag}:{i}", done=done))
        time.sleep(0.001)
        return emits


def _collect(request, out, key):
    try:
        out[key] = list(request)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        out[key] = exc


def _run_all(requests):
    out, threads = {}, []
    for key, request in requests.items():
        t = threading.Thread(target=_collect, args=(request, out, key), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(WAIT)
    assert len(out) == len(requests), "a request did not end"
    return out


def test_requests_step_together_up_to_the_capacity_and_each_gets_its_own_items():
    engine = Counter(capacity=3)
    with Chain([Stage.continuous("lm", engine), Stage.map("up", str.upper)], queue_size=64) as chain:
        requests = {tag: chain.submit((tag, n)) for tag, n in [("a", 5), ("b", 2), ("c", 4), ("d", 3)]}
        out = _run_all(requests)
    for tag, n in [("a", 5), ("b", 2), ("c", 4), ("d", 3)]:
        assert out[tag] == [f"{tag.upper()}:{i}" for i in range(n)]
    assert max(len(s) for s in engine.steps) == 3  # never more than the capacity
    assert any(len(s) > 1 for s in engine.steps)   # and several at once
    stats = chain.stats()
    assert stats["stages"]["lm"]["batch"]["max"] == 3 and stats["outcomes"]["done"] == 4


def test_a_slow_consumer_a_cancel_and_an_error_touch_only_their_own_request():
    engine = Counter(capacity=4)
    with Chain([Stage.continuous("lm", engine)], queue_size=2, send_timeout_s=0.3) as chain:
        slow = chain.submit(("slow", 50))
        cancelled = chain.submit(("gone", 50))
        bad = chain.submit(("bad", 10))
        good = chain.submit(("good", 30))
        next(iter(cancelled))
        cancelled.cancel()
        out = _run_all({"bad": bad, "good": good})
        assert out["good"] == [f"good:{i}" for i in range(30)]
        assert isinstance(out["bad"], StageError) and out["bad"].stage == "lm"
        with pytest.raises(SlowConsumer):
            deadline = time.monotonic() + WAIT
            while slow.state != "cancelled" and time.monotonic() < deadline:
                time.sleep(0.01)
            list(slow)
    assert slow.reason == "send_timeout" and cancelled.state == "cancelled"
    assert not engine.live  # everyone left the engine


def test_a_request_refused_at_join_or_a_broken_step_ends_only_what_it_must_and_the_next_is_served():
    engine = Counter(capacity=2)
    with Chain([Stage.continuous("lm", engine)], queue_size=64) as chain:
        out = _run_all({"refuse": chain.submit(("refuse", 3)), "ok": chain.submit(("ok", 3))})
        assert isinstance(out["refuse"], StageError) and out["ok"] == ["ok:0", "ok:1", "ok:2"]
        out = _run_all({"boom": chain.submit(("boom", 3))})
        assert isinstance(out["boom"], StageError) and "broke" in str(out["boom"].original)
        assert chain.submit(("after", 2)).result() == ["after:0", "after:1"]


def test_a_paused_request_holds_its_place_and_resumes_where_it_was():
    engine = Counter(capacity=2)
    with Chain([Stage.continuous("lm", engine)], queue_size=1) as chain:
        held = chain.submit(("held", 6))
        other = chain.submit(("other", 20))
        it = iter(held)
        first = next(it)
        assert other.result() == [f"other:{i}" for i in range(20)]  # went on while `held` was full
        assert [first, *it] == [f"held:{i}" for i in range(6)]


def test_the_admission_estimate_counts_the_engines_places():
    engine = Counter(capacity=2)
    with Chain([Stage.continuous("lm", engine)], queue_size=64) as chain:
        assert chain.estimate_first_item_ms() is None
        chain.submit(("warm", 3)).result()
        chain._held_ms.clear()
        chain._held_ms.append(100.0)
        chain._lag_ms.clear()
        chain._lag_ms.append(5.0)
        assert chain.estimate_first_item_ms() == pytest.approx(5.0)  # a free place: only the lag
        with chain._lock:  # two running (one place free soon), three queued behind them
            fake = [_Fake("running", time.perf_counter() - 0.05) for _ in range(2)] + \
                   [_Fake("queued", None) for _ in range(3)]
            chain._pending.update(fake)
        estimate = chain.estimate_first_item_ms()
        with chain._lock:
            chain._pending.difference_update(fake)
        # places free at ~50, ~50 -> queued take them (end ~150, ~150), the third at ~150, the 4th (this
        # one) at ~150: 150 + lag
        assert 140 < estimate < 160


class _Fake:
    def __init__(self, state, started):
        self.state, self.started = state, started


def test_a_continuous_stage_must_come_first_and_needs_an_engine():
    with pytest.raises(ConfigError):
        Stage.continuous("lm", object())
    with pytest.raises(ConfigError, match="first"):
        Chain([Stage.map("pre", str), Stage.continuous("lm", Counter())])
