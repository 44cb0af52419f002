"""Orpheus-style TTS serving many requests at once: every request a row of one captured decode step.
Each request's audio equals its audio alone (and the transformers + snac reference for the fixture
cases), whatever joins or leaves beside it; sampled speech reproduces under other neighbours; one
request's cancel or bad token ends only itself; no graph is captured after load."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from flashrt.chain import StageError
from flashrt.runner.tts import load_tts
from flashrt.runtime.decode import Sampling

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tts"
CASES = (("tara", "Hello there."), ("leo", "A much longer sentence, so the prompt lands in another bucket."))
GREEDY = Sampling()
TEXTS = ("Hi.", "Good morning to you all.", "Numbers: one, two, three, four, five.", "Short one.",
         "Another line of speech, of middling length.", "Yes.")
WAIT = 120.0


@pytest.fixture(scope="module")
def io():
    return load_file(FIXTURES / "orpheus_tiny_io.safetensors")


@pytest.fixture(scope="module")
def tts(one_thread):
    model = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=300, cache_len=512, slots=8)
    yield model
    model.close()


def _speak(tts, text, voice, sampling, delay=0.0):
    time.sleep(delay)
    return np.concatenate(list(tts.stream(text, voice=voice, sampling=sampling)))


def _at_once(tts, jobs):
    """jobs: key -> (text, voice, sampling, delay) streamed from one thread each -> key -> audio."""
    out = {}

    def run(key, job):
        try:
            out[key] = _speak(tts, *job)
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            out[key] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(out) == len(jobs), "a request did not end"
    return out


@pytest.mark.parametrize("concurrent", [1, 3, 8])
def test_each_request_sounds_as_it_does_alone_whoever_shares_its_steps(tts, io, concurrent):
    captures = tts.decoder.report()["captures"]
    voices = ("tara", "leo", "zoe")
    jobs = {k: (TEXTS[k % len(TEXTS)], voices[k % 3], GREEDY, 0.02 * (k % 4)) for k in range(concurrent)}
    jobs["ref0"] = (CASES[0][1], CASES[0][0], GREEDY, 0.01)
    jobs["ref1"] = (CASES[1][1], CASES[1][0], GREEDY, 0.03)
    together = _at_once(tts, jobs)
    for key in ("ref0", "ref1"):  # the transformers generate + snac reference
        i = int(key[-1])
        np.testing.assert_allclose(together[key], io[f"audio.{i}"][0].numpy(), atol=1e-4, rtol=0)
    for key, (text, voice, sampling, _) in jobs.items():
        alone = _speak(tts, text, voice, sampling)
        assert together[key].shape == alone.shape, key
        np.testing.assert_allclose(together[key], alone, atol=1e-5, rtol=0, err_msg=str(key))
    report = tts.decoder.report()
    assert report["captures"] == captures  # no capture since load
    if concurrent == 8:
        assert any(k.endswith(("@4", "@8")) for k in report["decode_replays"])
        assert tts.chain.stats()["stages"]["snac"]["batch"]["max"] > 1  # SNAC windows stacked as rows


def test_sampled_speech_reproduces_under_other_neighbours(tts):
    mine = ("Good morning to you all.", "tara", Sampling(temperature=0.7, top_p=0.9, repetition_penalty=1.1,
                                                         seed=5), 0.0)
    first = _at_once(tts, {"me": mine, "n1": (TEXTS[2], "leo", GREEDY, 0.0)})
    second = _at_once(tts, {"n2": (TEXTS[4], "zoe", GREEDY, 0.0), "n3": (TEXTS[0], "leo", GREEDY, 0.01),
                            "me": (*mine[:3], 0.02)})
    for run in (first, second):
        assert not isinstance(run["me"], BaseException), run["me"]
    np.testing.assert_array_equal(first["me"], second["me"])


def test_a_cancel_and_a_bad_token_end_only_their_own_requests(tts, io, monkeypatch):
    step = tts.decoder.step
    bad_text = "Numbers: one, two, three, four, five."

    def bad_step(blocks=1):  # a text token in the middle of one request's audio codes
        seats = step(blocks)
        for seat in seats:
            if seat.generation.prompt_len == len(tts.prompt_ids(bad_text, "zoe")) and \
                    len(seat.generation.tokens) >= 14 and seat.new:
                seat.new.append(5)
        return seats

    with monkeypatch.context() as patch:
        patch.setattr(tts.decoder, "step", bad_step)
        cancelled = tts.stream(TEXTS[4], voice="leo", sampling=GREEDY)
        next(cancelled)
        out = _at_once(tts, {"bad": (bad_text, "zoe", GREEDY, 0.0),
                             "ref0": (CASES[0][1], CASES[0][0], GREEDY, 0.0),
                             "ref1": (CASES[1][1], CASES[1][0], GREEDY, 0.01)})
        cancelled.close()
    assert isinstance(out["bad"], StageError) and out["bad"].stage == "lm"
    for i in (0, 1):
        np.testing.assert_allclose(out[f"ref{i}"], io[f"audio.{i}"][0].numpy(), atol=1e-4, rtol=0)
    assert tts.decoder.live == 0


def test_each_code_chunk_the_lm_sends_makes_one_snac_window_due(tts):
    """The lm stage sends a request's frames as its SNAC stream's windows fall due (the first window's
    chunk + right context, then each window's own chunk, growing as the stream goes): every chunk gives
    audio at once, none waits in a queue for the frames after it (one frame a chunk made the snac stage
    take a new request's first window one frame per call, behind the other requests' items)."""
    chunk, (_, right) = tts.vocoder.stream_chunk, tts.vocoder.frontend.context
    limit = tts.vocoder.max_stream_chunk
    assert limit == 16 > chunk == 4  # the CPU default: windows grow from 4 frames to 16
    plan = tts.chunk_plan
    dues = [plan.first]
    while len(dues) < 5:
        dues.append(plan.next_due(dues[-1]))
    assert dues == [n * chunk + right for n in (1, 2, 4, 8, 12)]
    before = tts.chain.stats()["stages"]
    audio = list(tts.stream(TEXTS[4], voice="leo", sampling=GREEDY))
    after = tts.chain.stats()["stages"]
    sent = after["lm"]["items"] - before["lm"]["items"]
    frames = tts.report()["frames"]
    while dues[-1] < frames:
        dues.append(plan.next_due(dues[-1]))
    assert frames > dues[2] and sent == len(audio) == 1 + sum(due < frames for due in dues)


def test_the_cpu_lm_replays_a_traced_step_with_the_eager_steps_tokens(tts):
    """On the CPU the LM's decode steps are traced into TorchScript (`flashrt.runtime.jit`) by default;
    several requests at once, greedy and sampled, get the audio of an eager LM bit for bit."""
    assert tts.decoder.backend.name == "jit"
    eager = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=300, cache_len=512, slots=8, lm_graphs="eager")
    try:
        assert eager.decoder.backend.name == "eager"
        sampled = Sampling(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=3)
        jobs = {k: (TEXTS[k], ("tara", "leo")[k % 2], sampled if k % 2 else GREEDY, 0.01 * k)
                for k in range(4)}
        jit_audio, eager_audio = _at_once(tts, jobs), _at_once(eager, jobs)
        for key in jobs:
            np.testing.assert_array_equal(jit_audio[key], eager_audio[key], err_msg=str(key))
    finally:
        eager.close()


def test_each_stage_runs_its_ops_on_its_share_of_the_free_cores(monkeypatch):
    """By default a voice's LM and SNAC stages share the cores free at load (two pools of torch's
    default on a 2-core machine oversubscribed it): the count each stage's ops run on, read inside
    the stages' own threads."""
    import torch

    from flashrt.frontends.orpheus import tts as orpheus
    from flashrt.runtime.threads import CpuLoad

    with monkeypatch.context() as patch:  # a machine of 6 free cores, torch set to 8 threads
        patch.setattr(orpheus.CpuLoad, "probe", classmethod(lambda cls: CpuLoad(6, 0)))
        patch.setattr(torch, "get_num_threads", lambda: 8)
        model = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=40, cache_len=256, slots=2)
    seen = []

    def spy(fn):
        def run(*args, **kwargs):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return fn(*args, **kwargs)
        return run

    try:
        assert model.threads == 3 and model.describe()["threads"] == 3
        monkeypatch.setattr(model.decoder, "step", spy(model.decoder.step))
        monkeypatch.setattr(model.vocoder, "decode_together", spy(model.vocoder.decode_together))
        list(model.stream("Hi.", voice="tara", sampling=GREEDY))
        assert {name for name, _ in seen} == {"flashrt-chain-lm", "flashrt-chain-snac"}
        assert {n for _, n in seen} == {3}
    finally:
        model.close()
    one = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=40, cache_len=256, slots=2, threads=1)
    try:
        assert one.threads == 1
    finally:
        one.close()
