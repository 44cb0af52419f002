"""Many requests on one Piper voice (`flashrt.frontends.vits.serving`): interleaved chunk by chunk, each
request's chunks identical to the request served alone, the listener due first served first, a failing
request ending only itself. A three-speaker voice with noise on (piper-tts's VITS fixture), so the
speaker vector and the prior noise each request keeps between its chunks matter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flashrt.chain import StageError
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.frontend import VitsFrontend
from flashrt.frontends.vits.model import load_weights
from flashrt.frontends.vits.serving import SpeechEngine
from flashrt.frontends.vits.voice import VitsVoice

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vits"
CHUNKS = {"first_chunk": 4, "chunk": 8}
REQUESTS = [  # text (long ones are cut into several sentences), speaker, seed, scales
    ("abba abab baba abba bbaa abab baab", "bob", 1, {"length_scale": 2.0}),
    ("ab ba", "ann", 2, {}),
    ("baab abba bb", 2, 3, {"length_scale": 1.8, "noise_w": 0.5}),
]


def _config(folder: Path):
    from flashrt.frontends.vocoders.hifigan import HifiGanConfig

    raw = json.loads((folder / "config.json").read_text())
    dec = raw.pop("decoder")

    def field(k, v):
        if k == "resblock_dilation_sizes":
            return tuple(map(tuple, v))
        return tuple(v) if isinstance(v, list) else v

    decoder = HifiGanConfig(in_channels=raw["inter_channels"], conv_post_bias=False,
                            **{k: field(k, v) for k, v in dec.items()})
    return replace(PRESETS["piper-medium"], **raw, dp_filter_channels=256, decoder=decoder)


@pytest.fixture(scope="module")
def voice():
    folder = FIXTURES / "ms_sdp"
    cfg = _config(folder)
    prior, dec = load_weights(folder / "model.ckpt", cfg)
    fe = VitsFrontend(cfg, prior, dec, phoneme_buckets=(32,), frame_buckets=(64, 128), window_buckets=(24,))
    config = {"phoneme_type": "text", "phoneme_id_map": {"_": [0], "^": [1], "$": [2], "a": [12], "b": [7]},
              "speaker_id_map": {"ann": 0, "bob": 2}}  # the default scales: noise on
    return VitsVoice(fe, config, threads=1)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _alone(voice, text, speaker, seed, scales):
    return list(voice.stream(text, seed=seed, voice=speaker, **CHUNKS, **scales))


def _job(voice, text, speaker, seed, scales):
    return voice.request(text, seed=seed, voice=speaker, **CHUNKS, **scales)


def _same(mine, theirs) -> bool:
    return len(mine) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(mine, theirs))


def test_every_request_starts_before_the_others_finish_and_equals_itself_alone(voice):
    """Driven step by step (a clock that stands still): each request's first window comes while the
    others are inside their sentences, so each one's flow runs on inputs it kept and put back."""
    alone = {r[2]: _alone(voice, *r) for r in REQUESTS}
    engine = SpeechEngine(voice, capacity=3, clock=_Clock())
    for r in REQUESTS:
        engine.join(r[2], _job(voice, *r))
    got: dict[int, list] = {seed: [] for seed in alone}
    order = []
    while engine.live:
        [emit] = engine.step()
        got[emit.request].append(emit.item)
        order.append(emit.request)
    assert order[:3] == [1, 2, 3]  # each started before any went on
    assert len(alone[1]) > 6
    for seed in alone:
        assert _same(got[seed], alone[seed]), seed


def test_interleaved_requests_equal_each_served_alone(voice):
    alone = [_alone(voice, *r) for r in REQUESTS]
    assert len(voice.request(REQUESTS[0][0]).sentences) > 1 and len(alone[0]) > 4
    chain = voice.serving_chain(capacity=3)
    order: list[int] = []
    engine = chain.stages[0].fn
    chunk = engine._chunk
    engine._chunk = lambda speech: (order.append(speech.job.seeds[0]), chunk(speech))[1]
    try:
        requests = [chain.submit(_job(voice, *r)) for r in REQUESTS]
        got = [list(r) for r in requests]
    finally:
        chain.close()
    for mine, theirs in zip(got, alone, strict=True):
        assert _same(mine, theirs)
    last_of_first = max(i for i, seed in enumerate(order) if seed == 1)
    assert order.index(3) < last_of_first  # the third request spoke before the first one finished


def test_the_listener_due_first_is_served_first(voice):
    """A new request's first chunk comes before the next chunk of a stream that has audio in hand; the
    streams whose audio ran out come before a new request, the earliest ended first; paused ones wait."""
    clock = _Clock()
    engine = SpeechEngine(voice, capacity=4, clock=clock)
    engine.join("a", _job(voice, *REQUESTS[0]))
    for _ in range(3):
        [emit] = engine.step()
        assert emit.request == "a" and emit.item.size > 0
    clock.now = engine.live["a"].audio_s / 2  # a has audio in hand
    engine.join("b", _job(voice, *REQUESTS[1]))
    assert [e.request for e in engine.step()] == ["b"]
    clock.now = 5.0  # a's and b's audio ran out long ago; c joins now
    engine.join("c", _job(voice, *REQUESTS[2]))
    for _ in range(2):  # the late ones first, the one whose audio ended earliest first
        due = {r: s.due() for r, s in engine.live.items()}
        [emit] = engine.step()
        assert emit.request == min(due, key=due.get) != "c"
    engine.pause("a", True)
    engine.pause("b", True)  # paused (their channels full): skipped
    assert [e.request for e in engine.step()] == ["c"]
    engine.pause("a", False)
    engine.leave("a")
    assert "a" not in engine.live


def test_a_failing_request_ends_only_itself(voice):
    alone = _alone(voice, *REQUESTS[1])
    chain = voice.serving_chain(capacity=2)
    bad = _job(voice, *REQUESTS[0])
    bad.sentences[1] = [1, 999, 2]  # an id beyond the voice's symbols: the frontend refuses it
    try:
        failing, good = chain.submit(bad), chain.submit(_job(voice, *REQUESTS[1]))
        with pytest.raises(StageError) as err:
            list(failing)
        assert isinstance(err.value.__cause__, InputError)
        got = list(good)
    finally:
        chain.close()
    assert _same(got, alone)


def test_capacity_is_checked(voice):
    with pytest.raises(ConfigError, match="capacity"):
        SpeechEngine(voice, capacity=0)


class _SlowClock:
    """Every reading is a second later: each chunk seems to take a second to compute."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_requests_join_only_while_the_voice_keeps_them_ahead_of_playback(voice):
    fast, slow = SpeechEngine(voice, capacity=3, clock=_Clock()), SpeechEngine(voice, capacity=3,
                                                                               clock=_SlowClock())
    for engine in (fast, slow):
        assert engine.capacity == 3  # nothing measured yet
        engine.join("a", _job(voice, *REQUESTS[1]))
        engine.step()
    assert fast.capacity == 3  # no time per chunk: every slot
    assert slow.capacity == 1 and slow.rtf > 1  # slower than real time: one at a time
