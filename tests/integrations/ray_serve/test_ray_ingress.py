"""The speech ingress of `flashrt.integrations.ray_serve` without Ray (its handles faked): it admits
``admit`` requests at once, a streamed one until its body ends, and refuses the others at once with
`flashrt serve`'s 503 (OpenAI's error shape, Retry-After); every way a request ends gives its slot back."""

import asyncio
import gc
import json

import numpy as np
import pytest

pytest.importorskip("starlette")

from flashrt.integrations.ray_serve import SpeechIngress  # noqa: E402
from flashrt.serve.app import ServerLimits  # noqa: E402

pytestmark = pytest.mark.timeout(30)


class _Chunks:
    """What a streaming handle call gives: async chunks and cancel()."""

    def __init__(self, count: int) -> None:
        self.left, self.cancelled = count, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> np.ndarray:
        if self.left == 0:
            raise StopAsyncIteration
        self.left -= 1
        return np.full(240, 0.1, dtype=np.float32)

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, call) -> None:
        self.call = call

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.call(*args)


class _Lm:
    async def _info(self):
        return {"sample_rate": 24000, "speakers": ("tara",)}

    def __init__(self) -> None:
        self.info = _Method(self._info)


class _Vocoder:
    def __init__(self) -> None:
        self.audio = _Method(lambda *args: _Chunks(3))


def _request(body: dict | None, headers: tuple = (), method: str = "POST", path: str = "/v1/audio/speech"):
    from starlette.requests import Request

    data = json.dumps(body).encode() if body is not None else b""
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers":
             [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
              *((k.encode(), v.encode()) for k, v in headers)], "query_string": b""}
    return Request(scope, receive)


def _speech(fmt="pcm", text="Hello.", headers: tuple = ()):
    return _request({"model": "tts-1", "voice": "tara", "input": text, "response_format": fmt}, headers)


def _ingress(admit: int, api_key: str | None = None) -> SpeechIngress:
    return SpeechIngress({"orpheus": _Lm()}, {"orpheus": _Vocoder()}, ServerLimits(retry_after_s=3), admit,
                         api_key)


def _refused(response) -> None:
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    error = json.loads(response.body)["error"]
    assert set(error) >= {"message", "type", "code"}
    assert (error["type"], error["code"]) == ("server_error", "server_busy")


async def _drain(response) -> bytes:
    return b"".join([part async for part in response.body_iterator])


def test_a_streamed_request_holds_its_slot_until_its_body_ends():
    async def run():
        ingress = _ingress(admit=1)
        streaming = await ingress(_speech())
        assert streaming.status_code == 200 and ingress.admission.held == 1
        _refused(await ingress(_speech()))  # the stream is still open: refused at once
        assert len(await _drain(streaming)) == 3 * 240 * 2  # three chunks of 16-bit pcm
        assert ingress.admission.held == 0
        again = await ingress(_speech())
        assert again.status_code == 200
        await _drain(again)

    asyncio.run(asyncio.wait_for(run(), 20))


def test_every_other_ending_gives_the_slot_back():
    async def run():
        ingress = _ingress(admit=1)
        whole = await ingress(_speech("wav"))  # answered whole: released on return
        assert whole.status_code == 200 and ingress.admission.held == 0
        bad = await ingress(_speech(text=""))  # refused by the checks: released
        assert bad.status_code == 400 and ingress.admission.held == 0
        unread = await ingress(_speech())  # a stream whose body never starts (its client went away)
        assert ingress.admission.held == 1
        del unread
        gc.collect()
        assert ingress.admission.held == 0

    asyncio.run(asyncio.wait_for(run(), 20))


def test_admission_counts_up_to_its_limit():
    async def run():
        ingress = _ingress(admit=3)
        held = [await ingress(_speech()) for _ in range(3)]
        assert all(r.status_code == 200 for r in held) and ingress.admission.held == 3
        _refused(await ingress(_speech()))
        for response in held:
            await _drain(response)
        assert ingress.admission.held == 0

    asyncio.run(asyncio.wait_for(run(), 20))


def _unauthorized(response) -> None:
    assert response.status_code == 401
    error = json.loads(response.body)["error"]
    assert error["code"] == "invalid_api_key" and set(error) >= {"message", "type", "code"}


def test_with_a_key_every_v1_route_wants_it_before_any_work():
    """As `flashrt serve --api-key`: no key, a wrong key or another scheme gets 401 in OpenAI's shape
    and takes no admission slot; the right bearer key is served; /health stays open."""
    async def run():
        ingress = _ingress(admit=1, api_key="s3cret")
        for headers in ((), (("authorization", "Bearer nope"),), (("authorization", "Basic s3cret"),)):
            _unauthorized(await ingress(_speech(headers=headers)))
            _unauthorized(await ingress(_request(None, headers, "GET", "/v1/models")))
            assert ingress.admission.held == 0
        good = (("authorization", "Bearer s3cret"),)
        served = await ingress(_speech(headers=good))
        assert served.status_code == 200
        await _drain(served)
        models = await ingress(_request(None, good, "GET", "/v1/models"))
        assert [m["id"] for m in json.loads(models.body)["data"]] == ["orpheus"]
        health = await ingress(_request(None, (), "GET", "/health"))
        assert health.status_code == 200

    asyncio.run(asyncio.wait_for(run(), 20))


def test_without_a_key_the_routes_are_open_and_a_blank_key_is_refused():
    async def run():
        served = await _ingress(admit=1)(_speech())
        assert served.status_code == 200
        await _drain(served)

    asyncio.run(asyncio.wait_for(run(), 20))
    with pytest.raises(ValueError, match="empty"):
        _ingress(admit=1, api_key="  ")
