import pytest
from support.bench_fakes import register_fake
from support.clock import FakeClock

from flashrt.bench.loop import BackgroundLoad, LoopConfig, run_loop, run_loop_benchmark, summarize_loop


class TimedPolicy:
    """Each step takes the next latency (ms) of the list on the fake clock; None raises."""

    def __init__(self, clock, latencies_ms, chunk_size=0):
        self.clock, self.latencies, self.calls = clock, list(latencies_ms), 0
        if chunk_size:
            self.chunk_size = chunk_size

    def step(self, obs):
        ms = self.latencies[self.calls % len(self.latencies)]
        self.calls += 1
        if ms is None:
            self.clock.t += 0.001
            raise RuntimeError("sensor glitch")
        self.clock.t += ms / 1e3
        return obs


def _loop(latencies, steps, **cfg):
    clock = FakeClock()
    policy = TimedPolicy(clock, latencies, cfg.pop("policy_chunk", 0))
    config = LoopConfig(rate_hz=100.0, steps=steps, **cfg)
    ticks = run_loop(policy, lambda k: k, config, clock=clock.now, sleep=clock.sleep)
    return ticks, summarize_loop(ticks, config)


def test_deadline_misses_dropped_ticks_and_action_age():
    ticks, s = _loop([2, 15, 3, 25, 1, 1], steps=9)
    assert [t.index for t in ticks] == [0, 1, 3, 4, 7, 8]
    assert [t.missed for t in ticks] == [False, True, False, True, False, False]
    assert [t.dropped_before for t in ticks] == [0, 0, 1, 0, 2, 0]
    assert [round(t.action_age_ms, 6) for t in ticks] == [2, 15, 3, 25, 1, 1]
    assert s["executed"] == 6 and s["missed"] == 2 and s["dropped_ticks"] == 3
    assert s["miss_rate"] == pytest.approx(2 / 6)
    assert s["latency"].max == pytest.approx(25) and s["latency"].deadline_misses == 2
    assert s["action_interval"].count == 5


def test_ticks_a_late_last_step_runs_past_are_dropped_too():
    ticks, s = _loop([1, 1, 35], steps=4)       # tick 2 ends at 55 ms: tick 3 (30 ms) never runs
    assert [t.index for t in ticks] == [0, 1, 2] and s["dropped_ticks"] == 1
    assert s["executed"] + s["dropped_ticks"] == 4


def test_errors_count_as_misses():
    ticks, s = _loop([1, None, 1], steps=6)
    assert s["errors"] == 2 and s["missed"] == 2 and s["latency"].failures == 2 and s["latency"].count == 4
    assert ticks[1].error == "RuntimeError: sensor glitch"


def test_chunk_boundaries_from_config_or_policy():
    _, s = _loop([5, 1, 1, 1], steps=12, chunk_size=4)
    assert s["boundaries"] == 3
    assert s["latency_boundary"].p50 == pytest.approx(5) and s["latency_inner"].p50 == pytest.approx(1)
    _, s = _loop([5, 1, 1], steps=9, policy_chunk=3)
    assert s["boundaries"] == 3 and s["latency_inner"].count == 6


def test_replanned_flag_wins_and_loop_benchmark_runs(tiny_profile, fake_name):
    register_fake(fake_name)
    record = run_loop_benchmark(fake_name, tiny_profile(), LoopConfig(rate_hz=500.0, steps=20))
    s = record["loop"]
    assert record["kind"] == "loop" and s["executed"] + s["dropped_ticks"] == 20   # every tick accounted
    assert s["boundaries"] == sum(1 for i in range(s["executed"]) if i % 4 == 0)  # FakePolicy.replanned
    assert len(record["ticks"]["done_ms"]) == s["executed"] and record["trace"]["length"] == 3


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_background_load_starts_and_stops(kind):
    with BackgroundLoad(1, kind) as load:
        assert all(w.is_alive() for w in load._running) and len(load._running) == 1
        workers = list(load._running)
    assert not any(w.is_alive() for w in workers)


def test_bad_config():
    with pytest.raises(ValueError):
        LoopConfig(rate_hz=0)
    with pytest.raises(ValueError):
        LoopConfig(load_kind="gpu")


# Boundaries (each case fails on the mutation named): a step that ends exactly on the next tick is on time
# (`>` not `>=` in `missed`), and a late step that ends exactly on a tick takes that tick's frame (the
# ceil in the tick arithmetic). Times are exact binary fractions at 128 Hz (period 7.8125 ms).
TICK_BOUNDARIES = {
    "ends exactly on the next tick": ([7.8125], 3, [0, 1, 2], [False, False, False], [0, 0, 0]),
    "ends just after the next tick": ([7.8125 + 2**-10], 3, [0, 2], [True, True], [0, 1]),
    "ends exactly two ticks later": ([15.625, 1.0], 3, [0, 2], [True, False], [0, 1]),
    "ends just after two ticks": ([15.625 + 2**-10, 1.0], 4, [0, 3], [True, False], [0, 2]),
}


@pytest.mark.parametrize("case", TICK_BOUNDARIES)
def test_tick_boundaries(case):
    latencies, steps, indices, missed, dropped = TICK_BOUNDARIES[case]
    clock = FakeClock()
    config = LoopConfig(rate_hz=128.0, steps=steps)
    ticks = run_loop(TimedPolicy(clock, latencies), lambda k: k, config, clock=clock.now, sleep=clock.sleep)
    assert [t.index for t in ticks] == indices
    assert [t.missed for t in ticks] == missed
    assert [t.dropped_before for t in ticks] == dropped
    assert summarize_loop(ticks, config)["latency"].deadline_misses == sum(
        lat > 7.8125 for lat in [t.latency_ms for t in ticks])


def test_action_age_counts_from_the_observation_the_chunk_came_from():
    """Chunk of 4 at 100 Hz, replans take 5 ms, queued pops 1 ms: a queued action executed at tick k
    is as old as the replanning tick's frame (k mod 4 periods + its pop), not 1 ms."""
    ticks, s = _loop([5, 1, 1, 1], steps=8, chunk_size=4)
    ages = [round(t.action_age_ms, 6) for t in ticks]
    assert ages == [5, 11, 21, 31, 5, 11, 21, 31]
    assert [round(t.time_to_pop_ms, 6) for t in ticks] == [5, 1, 1, 1, 5, 1, 1, 1]
    assert s["action_age"].max == pytest.approx(31) and s["time_to_pop"].max == pytest.approx(5)


def test_a_flashrt_policys_stages_nest_inside_each_step_of_the_loop_trace():
    """`flashrt loop --trace-out`: a Policy's stages (validate every tick; h2d, replay, postprocess when it
    replans) are recorded per tick and written inside that tick's step span."""
    from support import pi0_e2e as E2E

    from flashrt.bench.loop import _columns, loop_chrome_events
    from flashrt.runner.policy import load_policy

    case = E2E.case("pi05_cam2")
    policy = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, backend="eager")
    obs = case.obs(0)
    ticks = run_loop(policy, lambda k: obs, LoopConfig(rate_hz=1000.0, steps=6, chunk_size=0, warmup=0))
    names = [[s[0] for s in t.stages] for t in ticks]
    assert names[0] == ["validate", "h2d", "replay", "postprocess"]
    assert all(n in (["validate"], names[0]) for n in names) and names.count(names[0]) == sum(
        t.boundary for t in ticks)
    for t in ticks:
        for _, at, dur in t.stages:
            assert t.start_ms - 1e-3 <= at and at + dur <= t.done_ms + 1e-3   # inside the step
    events = loop_chrome_events({"ticks": _columns(ticks)})
    stages = [e for e in events if e.get("cat") == "stage"]
    assert [e["name"] for e in stages] == [s for n in names for s in n]
    assert all(e["ph"] == "X" and e["pid"] == 1 and e["dur"] >= 0 for e in stages)
