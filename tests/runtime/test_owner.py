"""The Runtime that owns the device: turn order (control first, a control call waits for at most the
replay running when it asks, a long eager replay gives way between module calls), no starvation of a
stream, errors and cancellation of one model never touch another, adopt/disown, reports."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flashrt.errors import ConfigError, InputError
from flashrt.runtime.owner import Runtime, find_graphs

WAIT = 30.0
TTS = Path(__file__).resolve().parents[1] / "fixtures" / "tts" / "orpheus_tiny"


class Point:
    """A replay point (a frontend-like object with replay(bucket)) that logs its start and end."""

    __module__ = "flashrt.testing.fake"

    def __init__(self, name, log, seconds=0.0, fail=False):
        self.name, self.log, self.seconds, self.fail = name, log, seconds, fail

    def replay(self, bucket=0):
        self.log.append((self.name, "start"))
        time.sleep(self.seconds)
        self.log.append((self.name, "end"))
        if self.fail:
            raise RuntimeError("replay failed")


class Model:
    __module__ = "flashrt.testing.fake"

    def __init__(self, point):
        self.frontend = {"graphs": [point]}


def _thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_control_call_goes_before_every_stream_replay_still_waiting():
    log = []
    rt = Runtime()
    arm, voice = rt.lane("policy", "control"), rt.lane("speech", "stream")
    speech, policy = Point("speech", log, 0.02), Point("policy", log)
    rt.adopt(Model(speech), voice)
    rt.adopt(Model(policy), arm)
    t = _thread(lambda: [speech.replay() for _ in range(20)])
    while len(log) < 4:
        time.sleep(0.001)
    log.append(("policy", "asked"))
    with arm.call():
        policy.replay()
    t.join(WAIT)
    asked = log.index(("policy", "asked"))
    granted = log.index(("policy", "start"))
    # between asking and its turn only the replay already running may end; no other starts
    assert [e for e in log[asked:granted] if e == ("speech", "start")] == []
    assert log.count(("speech", "end")) == 20 and arm.stats.calls == 1


def test_reservations_keep_the_device_free_at_each_control_release():
    log = []
    rt = Runtime(guard_ms=2.0)
    arm, voice = rt.lane("policy", "control", rate_hz=50), rt.lane("speech", "stream")
    speech, policy = Point("speech", log, 0.008), Point("policy", log, 0.002)
    rt.adopt(Model(speech), voice)
    rt.adopt(Model(policy), arm)
    stop = threading.Event()
    t = _thread(lambda: [speech.replay() for _ in iter(stop.is_set, True)])
    for _ in arm.ticks(25):
        with arm.call():
            policy.replay()
    stop.set()
    t.join(WAIT)
    report = rt.report()
    # the speech ran between the calls (not starved), and held back before releases
    assert report["speech"]["replays"] >= 10 and report["speech"]["deferred_replays"] > 0
    # no control call found a speech replay running when it was released, except when a replay was
    # already past its estimate (a replay never starts unless it is expected to end before the release)
    assert report["policy"]["waited_for_ms"].get("speech", 0.0) < 25 * 8


def test_a_stream_replay_longer_than_every_gap_is_not_starved():
    log = []
    rt = Runtime()
    arm, voice = rt.lane("policy", "control", rate_hz=100), rt.lane("speech", "stream")
    speech, policy = Point("speech", log, 0.03), Point("policy", log, 0.002)  # 30 ms > the 8 ms gaps
    rt.adopt(Model(speech), voice)
    rt.adopt(Model(policy), arm)
    done = []
    t = _thread(lambda: done.extend(speech.replay() or 1 for _ in range(3)))
    for _ in arm.ticks(60):  # 0.6 s of control at 100 Hz; the three replays need about 0.15 s
        with arm.call():
            policy.replay()
    assert len(done) == 3  # each ran right after a control call once it had waited a period
    t.join(WAIT)


def test_a_failing_replay_releases_the_device_and_the_other_lane_goes_on():
    log = []
    rt = Runtime()
    arm, voice = rt.lane("policy", "control"), rt.lane("speech", "stream")
    bad, policy = Point("speech", log, fail=True), Point("policy", log)
    rt.adopt(Model(bad), voice)
    rt.adopt(Model(policy), arm)
    with pytest.raises(RuntimeError):
        bad.replay()
    t = _thread(lambda: [policy.replay() for _ in range(3)])
    t.join(WAIT)
    assert log.count(("policy", "end")) == 3 and rt._holder is None


class Stack(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log = log
        self.layers = nn.ModuleList(Sleepy(log, i) for i in range(6))

    def forward(self):
        for layer in self.layers:
            layer()


class Sleepy(nn.Module):
    def __init__(self, log, i):
        super().__init__()
        self.log, self.i = log, i

    def forward(self):
        self.log.append(("layer", self.i))
        time.sleep(0.01)


class EagerModel:
    """An eager 'graph': its replay runs the module's Python forward (preemption points fire)."""

    __module__ = "flashrt.testing.fake"

    def __init__(self, module):
        self.module = module

    def replay(self):
        self.module()


def test_a_long_eager_replay_gives_way_between_module_calls():
    log = []
    rt = Runtime()
    arm, voice = rt.lane("policy", "control"), rt.lane("speech", "stream")
    speech, policy = EagerModel(Stack(log)), Point("policy", log)
    assert rt.adopt(speech, voice) == 1 and voice.yields
    rt.adopt(Model(policy), arm)
    t = _thread(speech.replay)
    while ("layer", 1) not in log:
        time.sleep(0.001)
    log.append(("policy", "asked"))
    with arm.call():
        policy.replay()
    t.join(WAIT)
    asked, granted = log.index(("policy", "asked")), log.index(("policy", "start"))
    assert len([e for e in log[asked:granted] if e[0] == "layer"]) <= 1  # one module call, not the rest
    assert [e for e in log if e[0] == "layer"] == [("layer", i) for i in range(6)]  # then it resumed
    rt.disown(speech)
    assert not rt._hooks and "replay" not in vars(speech)


def test_adopt_finds_the_replay_points_of_real_models_and_disown_restores_them(one_thread):
    from flashrt.runner.tts import load_tts

    tts = load_tts(TTS, max_new_tokens=60, cache_len=256, slots=2)
    try:
        before = np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1)))
        rt = Runtime()
        voice = rt.lane("speech", "stream")
        points = find_graphs(tts)
        assert rt.adopt(tts, voice) == len(points) >= 2 + 2 * 2  # prefill buckets, decode steps
        assert all(vars(p).get("_flashrt_lane") == "speech" for p in points)
        during = np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1)))
        assert voice.stats.replays > 0
        rt.disown(tts)
        after = np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1)))
        assert np.array_equal(before, during) and np.array_equal(before, after)
    finally:
        tts.close()


def test_bad_input_or_a_cancel_in_one_model_leaves_the_others_next_calls_bit_identical(one_thread):
    from flashrt.demo import ToyRobot, ensure_demo_checkpoint
    from flashrt.runner.policy import load_policy
    from flashrt.runner.tts import load_tts

    policy = load_policy(ensure_demo_checkpoint()[0])
    tts = load_tts(TTS, max_new_tokens=60, cache_len=256, slots=2)
    try:
        obs = ToyRobot().observe()
        want_actions = policy.infer(obs, seed=3)["actions"]
        want_audio = np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1)))
        rt = Runtime()
        arm, voice = rt.lane("policy", "control", rate_hz=20), rt.lane("speech", "stream")
        rt.adopt(policy, arm)
        rt.adopt(tts, voice)
        with pytest.raises(InputError), arm.call():
            policy.infer({**obs, "state": np.full(3, np.nan, np.float32)}, seed=3)
        assert np.array_equal(np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1))), want_audio)
        stream = tts.stream("Hello there.", voice="leo", seed=2)
        next(stream)
        stream.close()  # a cancelled utterance
        with arm.call():
            assert np.array_equal(policy.infer(obs, seed=3)["actions"], want_actions)
        with pytest.raises(InputError):
            tts("")
        assert np.array_equal(np.concatenate(list(tts.stream("Hi.", voice="tara", seed=1))), want_audio)
        assert rt.report()["policy"]["calls"] == 2 and rt._holder is None
    finally:
        tts.close()


def test_reports_count_misses_and_slack_and_the_trace_has_a_track_per_lane():
    rt = Runtime()
    arm = rt.lane("policy", "control", deadline_ms=5)
    rt.lane("speech", "stream")
    with arm.call():
        pass
    with arm.call():
        time.sleep(0.02)
    report = rt.report()["policy"]
    assert report["calls"] == 2 and report["misses"] == 1 and report["slack_ms"]["min"] < 0
    events = rt.chrome_events()
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"policy", "speech"} and sum(e["ph"] == "X" for e in events) == 2


def test_playback_counts_an_underrun_when_audio_comes_after_the_queue_ran_dry():
    lane = Runtime().lane("speech", "stream")
    lane.played(0.1, now=0.0)
    lane.played(0.1, now=0.05)   # in time: queued until 0.2
    lane.played(0.1, now=0.25)   # 50 ms late
    assert lane.stats.underruns == 1 and abs(lane.stats.underrun_ms - 50) < 1e-6
    lane.end_of_speech()
    lane.played(0.1, now=5.0)    # a new utterance: no gap counted
    assert lane.stats.underruns == 1


def test_bad_lanes_are_refused():
    rt = Runtime()
    with pytest.raises(ConfigError):
        rt.lane("x", "urgent")
    rt.lane("x", "stream")
    with pytest.raises(ConfigError):
        rt.lane("x", "control")
    with pytest.raises(ConfigError):
        rt.lane("y", "control", rate_hz=0)
    with pytest.raises(ConfigError):
        Runtime().adopt(object(), rt.lanes["x"])
    with pytest.raises(ConfigError):
        next(rt.lanes["x"].ticks(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lanes_run_their_replays_on_their_own_priority_streams():
    rt = Runtime()
    arm = rt.lane("policy", "control", cuda_priority=-1)
    x = torch.ones(1024, device="cuda")
    with arm.turn("k"):
        y = x * 2
        assert torch.cuda.current_stream() == arm._stream
    torch.cuda.synchronize()
    assert float(y.sum()) == 2048.0


def test_among_control_lanes_the_earliest_deadline_goes_first():
    log = []
    rt = Runtime()
    slow_arm = rt.lane("arm", "control", deadline_ms=5000)
    fast_arm = rt.lane("gripper", "control", deadline_ms=5)
    blocker = rt.lane("speech", "stream")
    hold = Point("speech", log, 0.3)
    rt.adopt(Model(hold), blocker)
    t = _thread(hold.replay)  # holds the device while both control calls ask
    while ("speech", "start") not in log:
        time.sleep(0.001)

    def call(lane, name):
        with lane.call():
            log.append((name, "start"))

    a = _thread(lambda: call(slow_arm, "arm"))
    time.sleep(0.01)  # the arm asks first, but its deadline is later
    b = _thread(lambda: call(fast_arm, "gripper"))
    for th in (t, a, b):
        th.join(WAIT)
    starts = [name for name, what in log if what == "start" and name != "speech"]
    assert starts == ["gripper", "arm"]
