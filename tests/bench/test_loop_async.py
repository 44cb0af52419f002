"""`flashrt loop --async` pieces: actions recorded per tick, the action age of a policy naming its
source tick, the boundary discontinuity, the AsyncPolicy loop view (on a fake clock), refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.clock import FakeClock

from flashrt.bench.loop import LoopConfig, run_loop, summarize_loop
from flashrt.bench.loop_async import AsyncLoopPolicy, async_summary, discontinuity
from flashrt.errors import ConfigError


class SourcePolicy:
    """2 ms per step; a new 'chunk' every 3 steps whose actions came from the frame 2 steps earlier."""

    def __init__(self, clock):
        self.clock, self.calls, self.source_step, self.replanned, self.chunk = clock, 0, 0, False, 0

    def step(self, obs):
        self.clock.t += 0.002
        self.replanned = self.calls % 3 == 0
        self.source_step = max(0, self.calls - 2) if self.replanned else self.source_step
        self.calls += 1
        self.chunk += self.replanned
        return np.array([float(self.chunk)])


def test_source_step_sets_the_action_age_and_actions_are_recorded():
    clock, actions = FakeClock(), []
    config = LoopConfig(rate_hz=100.0, steps=7)
    ticks = run_loop(SourcePolicy(clock), lambda k: k, config, clock=clock.now, sleep=clock.sleep,
                     actions=actions)
    sources = [0, 0, 0, 1, 1, 1, 4]  # the executed tick whose frame each action came from
    assert [round(t.action_age_ms, 6) for t in ticks] == [round(10 * (k - s) + 2, 6)
                                                          for k, s in enumerate(sources)]
    assert [float(a[0]) for a in actions] == [1, 1, 1, 2, 2, 2, 3]
    d = discontinuity([t.boundary for t in ticks], actions)
    assert d["boundary_max"] == 1 and d["boundary_p50"] == 1 and d["inner_max"] == 0


def test_discontinuity_skips_failed_ticks_and_takes_the_largest_dim():
    acts = [np.array([0.0, 0.0]), np.array([0.5, -2.0]), None, np.array([0.0, 0.0]), np.array([0.1, 0.0])]
    d = discontinuity([False, True, False, True, False], acts)
    assert d["boundary_max"] == 2.0 and d["inner_max"] == pytest.approx(0.1)
    assert math.isnan(discontinuity([False], [np.zeros(1)])["boundary_max"])


class ToyPolicy:
    """A flashrt-Policy-shaped toy: chunk 6, replan 3, instant inference, no guidance support."""

    chunk_size, n_action_steps, action_dim = 6, 3, 1

    def __init__(self):
        self.frontend, self.calls, self.seen = object(), 0, []

    def infer(self, obs, noise=None, seed=None, guide=None):
        self.seen.append((sorted(obs), noise))
        self.calls += 1
        return {"actions": np.full((6, 1), float(self.calls), np.float32)}


def test_async_loop_view_runs_every_tick_and_passes_noise_apart():
    clock, toy = FakeClock(), ToyPolicy()
    view = AsyncLoopPolicy(type("LoopPolicy", (), {"policy": toy, "obs_keys": ("state",)})(), 100.0)
    try:
        obs = {"state": 1, "noise": "n", "extra": 2}
        view.prime(obs)
        actions = []
        ticks = run_loop(view, lambda k: obs, LoopConfig(rate_hz=100.0, steps=20), clock=clock.now,
                         sleep=clock.sleep, actions=actions)
        s = summarize_loop(ticks, LoopConfig(rate_hz=100.0, steps=20))
        assert s["executed"] == 20 and s["errors"] == 0 and all(a is not None for a in actions)
        assert toy.seen[0] == (["state"], "n") and toy.calls >= 2
        assert all(t.action_age_ms >= 0 for t in ticks)
        view.close()  # the worker finishes the chunk in flight, if any
        summary = async_summary(view)
        assert summary["transition"] == "blend" and summary["chunks"] == toy.calls
    finally:
        view.close()


def test_async_needs_a_flashrt_policy():
    with pytest.raises(ConfigError, match="--async"):
        AsyncLoopPolicy(type("Block", (), {"step": lambda self, obs: 0})(), 50.0)
