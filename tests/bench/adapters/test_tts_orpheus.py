"""`flashrt bench tts-orpheus`: the adapter on the tiny preset (random weights, constrained frames)."""

from __future__ import annotations

import pytest
import torch

from flashrt.bench.adapters.tts_orpheus import OrpheusBenchmark
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import available
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer

FRAMES = 6


def profile(**shapes):
    data = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny", "chunk": FRAMES, **shapes},
            "bench": {"warmup": 1, "iters": 2, "trace_len": 2, "target_rate_hz": 1.0},
            "quality": {"reference": "trace", "atol": 1e-5, "rtol": 0.0}}
    return parse_profile(data, "tts-test")


@pytest.fixture(scope="module")
def bench(one_thread):
    made = OrpheusBenchmark(profile(), None, "cpu")
    yield made
    made.close()


def test_registered():
    assert "tts-orpheus" in available()


def test_a_call_is_one_constrained_utterance_timed_to_first_audio(bench):
    timer = StageTimer("cpu")
    inputs = bench.make_inputs(0)
    out = bench.run(inputs[0], timer)
    assert out["audio"].shape == (1, FRAMES * 64)  # the tiny SNAC: 64 samples a frame
    assert [r.stage for r in timer.records()] == ["ttfa", "rest"]
    assert set(bench.cold_start_ms) >= {"load", "capture", "first_ttfa", "first_call"}
    assert bench.tts.report()["tokens"] == 7 * FRAMES
    twin = bench.reference("trace")  # same weights on the trace backend: the same audio, bit for bit
    assert torch.equal(twin.run(inputs[0], StageTimer("cpu"))["audio"], out["audio"])
    twin.tts.close()


def test_refusals():
    with pytest.raises(ConfigError, match="preset"):
        OrpheusBenchmark(profile(preset="huge"), None, "cpu")
    with pytest.raises(ConfigError, match="random weights"):
        OrpheusBenchmark(profile(), "some/dir", "cpu")
