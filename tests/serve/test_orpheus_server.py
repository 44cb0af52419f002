"""The speech server over an Orpheus-style voice: its requests decode together (rows of one captured
step). Concurrent clients each get the audio of their request alone; OpenAI's ``voice`` picks the
speaker; a 40-client burst ends with every client served or refused at once, none timed out."""

import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from support.servers import RunningServer  # noqa: E402

from flashrt.runner.tts import load_tts, pcm16  # noqa: E402
from flashrt.runtime.decode import Sampling  # noqa: E402
from flashrt.serve.app import ServerLimits, SpeechServer  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tts" / "orpheus_tiny"
TEXTS = ("Hello there.", "Good morning to you all.", "Numbers: one, two, three.", "Yes.")
WAIT = 60.0


@pytest.fixture(scope="module")
def voice(one_thread):
    model = load_tts(FIXTURE, max_new_tokens=300, cache_len=512, slots=4, sampling=Sampling())
    yield model
    model.close()


@pytest.fixture(scope="module")
def server(voice):
    speech = SpeechServer({"orpheus": voice}, ServerLimits(max_pending=8))
    running = RunningServer(speech)
    yield running, speech
    running.stop()
    speech.close()


def _post(url, text, speaker, results, key):
    try:
        r = httpx.post(url + "/v1/audio/speech", timeout=WAIT,
                       json={"model": "tts-1", "voice": speaker, "input": text, "response_format": "pcm"})
        results[key] = (r.status_code, r.content)
    except httpx.HTTPError as exc:  # a timeout is what the burst test must never see
        results[key] = (None, repr(exc))


def _at_once(url, jobs):
    results = {}
    threads = [threading.Thread(target=_post, args=(url, text, speaker, results, key), daemon=True)
               for key, (text, speaker) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT + 5)
    assert len(results) == len(jobs)
    return results


def test_concurrent_clients_each_get_their_request_alone(server, voice):
    running, speech = server
    jobs = {k: (TEXTS[k % 4], ("tara", "leo", "zoe")[k % 3]) for k in range(6)}
    got = _at_once(running.url, jobs)
    import soxr

    for key, (text, speaker) in jobs.items():
        status, body = got[key]
        assert status == 200, body
        alone = voice(text, voice=speaker)  # OpenAI's voice picked the Orpheus speaker
        want = np.frombuffer(pcm16(soxr.resample(alone, voice.sample_rate, 24000)), dtype="<i2") \
            if voice.sample_rate != 24000 else np.frombuffer(pcm16(alone), dtype="<i2")
        have = np.frombuffer(body, dtype="<i2")
        assert have.shape == want.shape and np.abs(have.astype(int) - want).max() <= 1, key
    stages = speech.health()["chains"]["orpheus"]["stages"]
    assert stages["lm"]["batch"]["max"] > 1  # several requests decoded in one step


def test_a_burst_of_forty_is_served_or_refused_and_none_times_out(server):
    running, speech = server
    got = _at_once(running.url, {k: (TEXTS[k % 4], "tara") for k in range(40)})
    statuses = [status for status, _ in got.values()]
    assert None not in statuses, [body for status, body in got.values() if status is None][:1]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 8
    after = httpx.post(running.url + "/v1/audio/speech", timeout=WAIT,
                       json={"model": "tts-1", "voice": "leo", "input": "After the burst.",
                             "response_format": "pcm"})
    assert after.status_code == 200 and len(after.content) > 0
