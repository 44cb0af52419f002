"""AsyncPolicy: the schedule (request tick, takeover tick, dropped positions), real-time chunking
through the captured Pi0.5 step (equal to `infer` with the Guidance written out by hand), the blend,
late and starved chunks on a toy policy whose inference the test holds, errors, reset."""

from __future__ import annotations

import threading
import time
from functools import cache

import numpy as np
import pytest
from support import pi0_e2e as E2E

from flashrt.errors import ConfigError, InputError
from flashrt.runner.async_policy import AsyncPolicy
from flashrt.runner.policy import load_policy
from flashrt.runtime.rtc import Guidance

CASE = "pi05_cam1"  # chunk 6, n_action_steps 4


@cache
def policy():
    return load_policy(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER)


def _obs(k: int) -> dict:
    return E2E.case(CASE).obs(k % 3)


@pytest.mark.parametrize("transition", ["rtc", "blend", "none"])
def test_schedule_and_transitions_on_pi05(one_thread, transition):
    """d = 2, margin 1, n_action_steps 4: chunk 0 at tick 0; chunk 1 requested at tick 2 (executed
    2 >= 4 - d) with tick 2's observation, takes over at tick 4 from its position 2."""
    with AsyncPolicy(policy(), transition=transition, delay_steps=2, on_late="wait") as ap:
        got = [ap.step(_obs(k), seed=10) for k in range(6)]
        c0 = policy().infer(_obs(0), seed=10)["actions"]
        guide = Guidance(c0[2:6], 2, 4) if transition == "rtc" else None
        c1 = policy().infer(_obs(2), seed=11, guide=guide)["actions"]
        want = [c0[0], c0[1], c0[2], c0[3], c1[2], c1[3]]
        if transition == "blend":
            want[4] = (1 - 1 / 3) * c0[4] + 1 / 3 * c1[2]
            want[5] = (1 - 2 / 3) * c0[5] + 2 / 3 * c1[3]
        for k, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), (transition, k)
        schedule = [(c.request_step, c.takeover_step, c.delay_steps) for c in ap.chunks[:2]]
        assert schedule == [(0, 0, 0), (2, 4, 2)]
        assert ap.chunks[1].mode == transition and ap.chunks[1].frozen == 4
        assert ap.ages == [0, 1, 2, 3, 2, 3] and ap.source_step == 2
        assert ap.chunks[1].takeover_gap == pytest.approx(float(np.abs(want[4] - c0[4]).max()), abs=1e-6)
        if transition == "rtc":  # the guided chunk agrees with what executed while it was inferred
            free = policy().infer(_obs(2), seed=11)["actions"]
            assert np.abs(c1[:2] - c0[2:4]).max() < 0.2 * np.abs(free[:2] - c0[2:4]).max()


def test_auto_picks_rtc_where_the_family_supports_it():
    with AsyncPolicy(policy()) as ap:
        assert ap.transition == "rtc"
    with AsyncPolicy(Toy()) as ap:
        assert ap.transition == "blend"
    with pytest.raises(ConfigError, match="real-time chunking"):
        AsyncPolicy(Toy(), transition="rtc")


class Toy:
    """chunk 8, replan 4; chunk k (k-th infer) is 100 k + position; infer waits for `gate` when set."""

    chunk_size, n_action_steps, action_dim = 8, 4, 1

    def __init__(self) -> None:
        self.frontend = type("F", (), {})()
        self.calls, self.gate, self.started = 0, None, threading.Event()

    def infer(self, obs, noise=None, seed=None, guide=None):
        if obs.get("bad"):
            raise InputError("state: bad")
        k, self.calls = self.calls, self.calls + 1
        self.started.set()
        if self.gate is not None and k > 0:
            self.gate.wait()
        return {"actions": (100.0 * k + np.arange(self.chunk_size, dtype=np.float32))[:, None]}


def _wait_done(ap: AsyncPolicy) -> None:
    while ap._done.empty():  # synchronisation only: the worker finishing, not a timing assertion
        time.sleep(0.001)


def test_late_chunk_keeps_the_old_one_running_then_drops_the_ticks_that_passed():
    toy = Toy()
    toy.gate = threading.Event()
    with AsyncPolicy(toy, transition="none", delay_steps=1, margin=0) as ap:
        got = [float(ap.step({})[0]) for _ in range(6)]  # request at tick 3 (executed 3 >= 4 - 1)
        assert got == [0, 1, 2, 3, 4, 5] and ap.late == 1 and ap.chunks[1].request_step == 3
        toy.gate.set()
        _wait_done(ap)
        assert float(ap.step({})[0]) == 103  # tick 6: 3 ticks after the request -> position 3
        assert ap.chunks[1].takeover_step == 6 and ap.starved == 0


def test_starved_queue_waits_for_the_chunk():
    toy = Toy()
    toy.gate = threading.Event()
    with AsyncPolicy(toy, transition="none", delay_steps=1, margin=0) as ap:
        for _ in range(8):
            ap.step({})
        out = []
        worker = threading.Thread(target=lambda: out.append(float(ap.step({})[0])))
        worker.start()
        toy.started.wait()
        toy.gate.set()
        worker.join(timeout=60)
        assert out == [105] and ap.starved >= 1  # requested at tick 3, taken at tick 8


def test_error_surfaces_at_takeover_and_the_old_chunk_stays():
    with AsyncPolicy(Toy(), transition="none", delay_steps=1, on_late="wait") as ap:
        for _ in range(3):
            ap.step({})
        ap.step({"bad": True})  # request with a bad observation at tick 3
        with pytest.raises(InputError, match="state"):
            ap.step({})
        # the failed tick executed nothing: the old chunk goes on, a new chunk is requested right away
        assert float(ap.step({})[0]) == 4 and ap.chunks[-1].request_step == 4


def test_reset_starts_a_new_episode():
    with AsyncPolicy(Toy(), transition="none", delay_steps=1, on_late="wait") as ap:
        for _ in range(5):
            ap.step({})
        ap.reset()
        assert ap.steps == 0 and ap.chunks == []
        assert float(ap.step({})[0]) % 100 == 0


@pytest.mark.parametrize("kwargs", [dict(rate_hz=0), dict(margin=-1), dict(delay_steps=8),
                                    dict(transition="fade"), dict(schedule="cos"), dict(on_late="skip")])
def test_bad_options(kwargs):
    with pytest.raises(ConfigError):
        AsyncPolicy(Toy(), **kwargs).close()


# ------------------------------------------------ inputs copied on entry, lifecycle, bounded histories


class Echo:
    """chunk 8, replan 4: a chunk is 10 x the observation's state (read by the worker when it infers)
    plus the position; `gate` holds the worker before it reads the observation."""

    chunk_size, n_action_steps, action_dim = 8, 4, 3

    def __init__(self) -> None:
        self.frontend = type("F", (), {})()
        self.gate, self.entered = None, threading.Event()

    def infer(self, obs, noise=None, seed=None, guide=None):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(60)
        state = np.array(obs["state"], dtype=np.float32, copy=True)
        return {"actions": 10 * state[None, :] + np.arange(self.chunk_size, dtype=np.float32)[:, None]}


def test_the_worker_infers_from_the_observation_as_it_was_at_the_call():
    """A robot loop writes its next observation into the same array right after `step` returns; the
    chunk must come from the observation given, not the half-written next one."""
    echo = Echo()
    with AsyncPolicy(echo, transition="none", delay_steps=1, margin=0, on_late="wait") as ap:
        state = np.zeros(3, np.float32)
        ap.step({"state": state})                 # chunk 0 (from zeros), waited for
        for tick in range(1, 4):
            state[:] = tick
            echo.gate, echo.entered = threading.Event(), threading.Event()
            ap.step({"state": state})             # at tick 3 the next chunk is requested with state 3
        assert echo.entered.wait(60)              # the worker took that job ...
        state[:] = 99.0                           # ... and the loop reuses its array at once
        echo.gate.set()
        got = [float(ap.step({"state": state})[0]) for _ in range(4)]
    assert got == [31, 32, 33, 34]  # ticks 4..7: the chunk inferred from state 3 (not 99), positions 1..4


def test_noise_is_copied_too():
    seen = []

    class Noisy(Echo):
        def infer(self, obs, noise=None, seed=None, guide=None):
            self.entered.set()
            self.gate.wait(60)
            seen.append(np.array(noise, copy=True))
            return super().infer(obs)

    policy = Noisy()
    policy.gate = threading.Event()
    with AsyncPolicy(policy, transition="none") as ap:
        noise = np.ones((8, 3), np.float32)
        t = threading.Thread(target=lambda: ap.step({"state": np.zeros(3)}, noise=noise))
        t.start()
        assert policy.entered.wait(60)  # the request is in the worker: `step` has taken its inputs
        noise[:] = -1  # written while the first request waits in the worker
        policy.gate.set()
        t.join(60)
    assert np.array_equal(seen[0], np.ones((8, 3), np.float32))


def test_step_after_close_raises_at_once():
    ap = AsyncPolicy(Toy(), transition="none")
    ap.step({})
    ap.close()
    box = []
    t = threading.Thread(target=lambda: box.append(pytest.raises(ConfigError, ap.step, {})))
    t.start()
    t.join(10)
    assert not t.is_alive() and box and "closed" in str(box[0].value)


def test_an_unclosed_async_policy_stops_its_worker_when_collected():
    import gc

    def workers():
        return [t for t in threading.enumerate() if t.name == "flashrt-async-policy"]

    before = len(workers())
    ap = AsyncPolicy(Toy(), transition="none")
    ap.step({})
    worker = ap._worker
    del ap
    gc.collect()
    worker.join(10)
    assert not worker.is_alive() and len(workers()) == before


def test_histories_stay_bounded_within_an_episode(monkeypatch):
    monkeypatch.setattr("flashrt.runner.async_policy.HISTORY", 16)
    with AsyncPolicy(Toy(), transition="none", delay_steps=1, on_late="wait") as ap:
        for _ in range(400):
            ap.step({})
        assert 16 <= len(ap.ages) < 32 and ap.ages[-1] == ap.steps - 1 - ap.source_step
        last = ap.chunks[-1].index
        assert 16 <= len(ap.chunks) < 32 and last >= 99  # 400 ticks, a chunk every 4
        assert [c.index for c in ap.chunks] == list(range(last + 1 - len(ap.chunks), last + 1))


def test_the_queue_length_branch_requests_at_equality():
    """chunk 8 = n_action_steps (the executed-count branch would wait until 8 - d = 6 executed), d = 2,
    margin 1: the request comes at the tick where the actions left (this tick's included) equal
    d + margin = 3, i.e. tick 5; with '<' instead of '<=' it would come one tick late, at 6."""

    class Long(Toy):
        n_action_steps = 8

    with AsyncPolicy(Long(), transition="none", delay_steps=2, margin=1, on_late="wait") as ap:
        for _ in range(7):
            ap.step({})
        assert [c.request_step for c in ap.chunks[:2]] == [0, 5]
        assert ap.chunks[1].frozen == 3  # the queue it was requested with: 3 actions left


class _ReadsLate:
    """Pi0.5 whose worker reads the observation of a request made at tick T only after the caller has
    written tick T + 1's observation into the same arrays (`writes` counts them; the first chunk is
    exempt: `step` waits for it, so the caller cannot write meanwhile)."""

    def __init__(self, policy) -> None:
        self.policy, self.frontend = policy, policy.frontend
        self.chunk_size, self.n_action_steps = policy.chunk_size, policy.n_action_steps
        self.writes, self.calls, self.async_policy = 0, 0, None
        self.written = threading.Condition()

    def wrote(self) -> None:
        with self.written:
            self.writes += 1
            self.written.notify_all()

    def infer(self, obs, noise=None, seed=None, guide=None):
        requested = self.async_policy.chunks[-1].request_step  # the chunk in flight (one at a time)
        with self.written:
            self.calls += 1
            if self.calls > 1:
                assert self.written.wait_for(lambda: self.writes > requested, timeout=60)
        return self.policy.infer(obs, noise=noise, seed=seed, guide=guide)


def test_a_loop_that_reuses_its_arrays_gets_the_chunks_of_the_observations_it_gave():
    """A robot loop writes each next observation into the same state and image arrays right after
    `step` returns; every executed action equals the synchronous policy's chunk for a copy of the
    observation of the tick it came from."""
    late = _ReadsLate(policy())
    first = _obs(0)
    state, image = first["state"].copy(), first["images"]["top"].copy()
    obs = {"images": {"top": image}, "state": state, "prompt": first["prompt"]}
    given, executed = [], []
    with AsyncPolicy(late, transition="none", delay_steps=1, margin=0, on_late="wait") as ap:
        late.async_policy = ap
        for tick in range(12):
            given.append({"images": {"top": image.copy()}, "state": state.copy(), "prompt": obs["prompt"]})
            executed.append((ap.step(obs, seed=20), ap.source_step))
            state[:] = first["state"] + 0.25 * (tick + 1)  # the next observation, written in place
            image[:] = np.roll(first["images"]["top"], 3 * (tick + 1), axis=1)
            late.wrote()
        index = {c.request_step: c.index for c in ap.chunks}
    assert len(index) >= 3  # replanned from reused arrays more than once
    for tick, (action, source) in enumerate(executed):
        chunk = policy().infer(given[source], seed=20 + index[source])["actions"]
        assert np.array_equal(action, chunk[tick - source]), tick
