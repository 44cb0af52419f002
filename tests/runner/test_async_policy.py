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
