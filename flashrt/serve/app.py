"""An OpenAI-compatible speech server over loaded TTS models, fed through `flashrt.chain`.

    POST /v1/audio/speech   {"model", "input", "voice", "response_format", "speed", "seed"?}
                            -> audio streamed as it is produced (chunked transfer)
    GET  /v1/models         the loaded voices, OpenAI list format
    GET  /health            status, voices, chain statistics
    GET  /metrics           Prometheus metrics (`flashrt.serve.metrics`)

With an API key (``SpeechServer(..., api_key=...)``, ``flashrt serve --api-key``) every ``/v1/`` route
wants ``Authorization: Bearer <key>`` (what OpenAI's clients send) and answers 401 ``invalid_api_key``
otherwise; ``/health`` and ``/metrics`` stay open for probes and scrapers.

ASGI stack: Starlette + uvicorn (small, maintained, no extra schema layer; the request body is checked
here field by field so each error names its field). Requests are validated, then submitted to the
voice's `Chain`: the model's own when it has one for serving (``model.serving_chain(...)``, fed the
model's checked ``model.request(...)``: an Orpheus-style voice decodes its requests together, each a
row of one captured decode step), else one ``speech`` stage calling ``model.stream(text, ...)`` for
one request after another; the response starts only after the first audio chunk, so a request the
model refuses still gets its 400.

Errors (OpenAI shape ``{"error": {"message", "type", "param", "code"}}``):

    400  malformed or too deeply nested JSON, empty or too long input, NUL characters or lone
         surrogates in a text field, unknown voice/model, a response_format that is unknown or whose
         encoder is not installed (the message lists the formats this server serves), text the model
         cannot speak (the model's refusal, also when it comes from inside the synthesis)
    413  body larger than ``max_body_bytes``
    422  a field of the wrong type (JSON booleans are not numbers), a missing field, speed out of
         [0.25, 4] (or not finite), a seed that is not an integer in [0, SEED_MAX]
    503  the chain holds ``max_pending`` requests already (code ``server_busy``), or the request's
         time-to-first-audio deadline cannot be met (code ``deadline_unmeetable``: the wait estimated
         from the voice's measured service times and its queue exceeds it); ``Retry-After`` says when
         to retry. Refused at once, never left to time out. Also ``server_shutting_down``: the server
         is closing (its requests end; a stream already sending audio is cut without the chunked
         body's end, so no client mistakes part of an utterance for all of it).
    500  the model failed, or anything unexpected (still in the OpenAI shape; the server keeps serving)

Memory is bounded: the body is read up to its limit, each request's chain links hold ``queue_size``
chunks, at most ``max_pending`` requests are held. A waiting request holds no thread (the chain's
async wait is an asyncio future), so any number of clients beyond ``max_pending`` or the executor's
size is served or refused, never wedged. A client that disconnects cancels its request at once (a
watcher on the connection, not the next chunk's failed write); a client that stops reading has its
request cancelled after ``send_timeout_s`` without a read, so the voice serves the next one.
``response_format`` (`flashrt.serve.formats`, default ``wav``): ``wav`` and ``flac`` are one complete
file at the voice's own rate with its true length in the header, sent once the utterance is done (a
reader that trusts the header gets the right duration); ``pcm``, ``mp3`` and ``opus`` stream as the audio
is synthesized (``pcm`` is what OpenAI advises for low latency: raw 16-bit little-endian mono at 24 kHz,
as OpenAI defines it; a voice of another rate is resampled on the fly with soxr, so clients written for
OpenAI play it at the right speed). mp3, opus and flac need the ``soundfile`` package (``serve`` extra);
without it they are a 400 naming the formats this server can serve (also listed by ``/health``). Every
audio response says its rate in an ``X-Sample-Rate`` header.
``model`` may be a voice name, ``flashrt`` or an OpenAI model name (tts-1, tts-1-hd, gpt-4o-mini-tts);
``voice`` picks the loaded voice, or a speaker of a loaded model that lists ``speakers`` (an Orpheus-style
model: tara, leo, ...), passed to its ``stream(..., voice=speaker)``: the model ``model`` names, or with an
OpenAI model name the only loaded model that lists that speaker. ``ttfa_deadline_ms`` (a flashrt
extension, like ``seed``) sets the request's deadline for its first audio; the server's default is
``ServerLimits.ttfa_deadline_ms`` (none: admit whatever fits in ``max_pending``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from flashrt.chain import Chain, ChainFull, SlowConsumer, Stage, StageError
from flashrt.errors import InputError
from flashrt.io.inputs import SEED_MAX
from flashrt.serve import formats
from flashrt.serve.formats import FORMATS, PCM_RATE, AudioFormat, sized_wav, wav_header

__all__ = ["ServerLimits", "SpeechServer", "build_app", "wav_header", "sized_wav", "OPENAI_MODELS", "FORMATS",
           "PCM_RATE"]

OPENAI_MODELS = ("flashrt", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
FIELDS = {
    "model": str,
    "input": str,
    "voice": str,
    "response_format": str,
    "speed": (int, float),
    "seed": int,
    "instructions": str,
    "stream_format": str,
    "ttfa_deadline_ms": (int, float),
}


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 64 * 1024
    max_input_chars: int = 4096
    max_pending: int = 16
    queue_size: int = 4
    retry_after_s: int = 1
    send_timeout_s: float = 30.0  # a client that reads nothing for this long loses its request
    ttfa_deadline_ms: float | None = None  # default deadline for the first audio (None: no admission check)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str = "invalid_request",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Speech:
    """One validated request."""

    voice: str  # the loaded model that speaks
    text: str
    fmt: str
    speed: float
    seed: int | None
    speaker: str | None = None  # a speaker of that model (models that list `speakers`)
    deadline_ms: float | None = None  # first audio wanted within this (admission refuses otherwise)


class SpeechServer:
    """The voices, one chain each, and the request checks (module docstring)."""

    def __init__(self, voices: Mapping[str, Any], limits: ServerLimits = ServerLimits(),
                 api_key: str | None = None, formats: Mapping[str, AudioFormat] = FORMATS) -> None:
        if not voices:
            raise ValueError("a speech server needs at least one voice")
        if api_key is not None and not api_key.strip():
            raise ValueError("an API key must not be empty")
        self.api_key = api_key
        self.closing = False
        self.voices, self.limits, self.formats = dict(voices), limits, dict(formats)
        self.refusals = {"server_busy": 0, "deadline_unmeetable": 0}
        self.chains = {name: self._chain(model) for name, model in self.voices.items()}
        from flashrt.serve import metrics

        self.metrics = metrics.SpeechMetrics(self.chains) if metrics.available() else None

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries this server's key (always, without a key)."""
        return bearer_authorized(header, self.api_key)

    def answered(self, voice: str, status: int, code: str = "") -> None:
        if self.metrics is not None:
            self.metrics.answered(voice, status, code)
    def _chain(self, model: Any) -> Chain:
        """The model's own chain when it serves several requests at once (``serving_chain``: its
        requests decode together), else one stage streaming one request after another."""
        limits = {"queue_size": self.limits.queue_size, "max_pending": self.limits.max_pending,
                  "send_timeout_s": self.limits.send_timeout_s}
        serving = getattr(model, "serving_chain", None)
        if callable(serving):
            return serving(**limits)
        return Chain([Stage("speech", self._stage(model))], **limits)

    def _payload(self, job: Speech) -> Any:
        """What the voice's chain takes: the model's checked request for a serving chain (its InputError
        a 400 before anything is queued), else the Speech itself."""
        model = self.voices[job.voice]
        if not callable(getattr(model, "serving_chain", None)):
            return job
        extra = {"voice": job.speaker} if job.speaker else {}
        try:
            return model.request(job.text, seed=job.seed, speed=job.speed, **extra)
        except InputError as exc:
            raise ApiError(400, str(exc), "input", "invalid_input") from None

    @staticmethod
    def _stage(model: Any):
        def speak(items, request):
            job: Speech = next(iter(items))
            extra = {"voice": job.speaker} if job.speaker else {}
            yield from model.stream(job.text, seed=job.seed, speed=job.speed, **extra)

        return speak

    # --------------------------------------------------------------------------------- checking

    def parse(self, body: bytes) -> Speech:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(422, "the request body must be a JSON object", code="invalid_type")
        for name in ("model", "input", "voice"):
            if name not in data:
                raise ApiError(422, f"missing required field {name!r}", name, "missing_field")
        for name, value in data.items():
            kind = FIELDS.get(name)
            if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ApiError(422, f"{name}: wrong type {type(value).__name__}", name, "invalid_type")
            if isinstance(value, str):
                _check_text(name, value)
        return self._values(data)

    def _values(self, data: Mapping[str, Any]) -> Speech:
        text, voice, model = data["input"], data["voice"], data["model"]
        if not text.strip():
            raise ApiError(400, "input is empty", "input", "empty_input")
        if len(text) > self.limits.max_input_chars:
            raise ApiError(
                400,
                f"input has {len(text)} characters; the limit is {self.limits.max_input_chars}",
                "input",
                "input_too_long",
            )
        speaker = None
        if voice not in self.voices:
            owner = self._speaker_owner(model, voice)
            if owner is None:
                raise ApiError(
                    400, f"unknown voice {voice!r}; voices: {sorted(self.voices)}", "voice", "unknown_voice"
                )
            voice, speaker = owner, data["voice"]
        if model not in self.voices and model not in OPENAI_MODELS:
            raise ApiError(
                400,
                f"unknown model {model!r}; models: {sorted([*self.voices, *OPENAI_MODELS])}",
                "model",
                "model_not_found",
            )
        fmt = self._format(data.get("response_format", "wav"))
        if data.get("stream_format", "audio") != "audio":
            raise ApiError(
                400, "stream_format: only 'audio' is supported", "stream_format", "unsupported_format"
            )
        deadline = _deadline(data.get("ttfa_deadline_ms", self.limits.ttfa_deadline_ms))
        return Speech(voice, text, fmt, _speed(data.get("speed", 1.0)), _seed(data.get("seed")), speaker,
                      deadline)

    def _speaker_owner(self, model: str, speaker: str) -> str | None:
        """The loaded model that speaks ``speaker`` (one of its ``speakers``): the one ``model`` names,
        or, for an OpenAI model name, the only loaded model that lists it (so OpenAI clients, whose
        model is fixed, pick an Orpheus speaker by ``voice`` alone)."""
        if model in self.voices:
            return model if speaker in getattr(self.voices[model], "speakers", ()) else None
        owners = [name for name, m in self.voices.items() if speaker in getattr(m, "speakers", ())]
        return owners[0] if len(owners) == 1 and model in (*OPENAI_MODELS, "flashrt") else None

    def _format(self, name: str) -> str:
        """`name` when this server can encode it; else a 400 naming the formats it can."""
        fmt = self.formats.get(name)
        why = "is not supported" if fmt is None else fmt.missing()
        if why is not None:
            raise ApiError(400, f"response_format {name!r} {why}; use one of "
                           f"{formats.available(self.formats)}", "response_format", "unsupported_format")
        return name

    # ---------------------------------------------------------------------------------- serving

    async def speak(self, job: Speech) -> tuple[bytes, AsyncIterator[Any], Any, Any]:
        """Submit, wait for the first chunk; (first bytes, the rest, the chain request, the encoder of
        the rest)."""
        if self.closing:
            raise ApiError(503, "the server is shutting down; retry", code="server_shutting_down",
                           retry_after_s=1)
        chain = self.chains[job.voice]
        payload = self._payload(job)
        self._admit(chain, job)
        try:
            request = chain.submit(payload)
        except ChainFull as exc:
            self.refusals["server_busy"] += 1
            raise ApiError(503, f"busy: {exc}", code="server_busy") from None
        chunks = request.__aiter__()
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            if request.state == "cancelled":  # the server closed the chain (shutting down): not the input
                raise ApiError(503, "the server is shutting down; retry", code="server_shutting_down",
                               retry_after_s=1) from None
            raise ApiError(400, "nothing to say", "input", "empty_audio") from None
        except StageError as exc:
            request.cancel()
            if isinstance(exc.original, InputError):
                raise ApiError(400, str(exc.original), "input", "invalid_input") from None
            raise ApiError(500, f"synthesis failed: {exc.original}", code="server_error") from None
        except SlowConsumer:  # cannot happen before the first chunk is read; kept for completeness
            raise ApiError(408, "the client read nothing in time", code="send_timeout") from None
        except BaseException:
            request.cancel()
            raise
        try:
            encoder = formats.encoder(self.formats[job.fmt], self.voices[job.voice].sample_rate)
            return encoder.head() + encoder(first), chunks, request, encoder
        except BaseException:
            request.cancel()
            raise

    def _admit(self, chain: Chain, job: Speech) -> None:
        """503 at once when the first audio could not come within the request's deadline."""
        if job.deadline_ms is None:
            return
        estimate = chain.estimate_first_item_ms()
        if estimate is not None and estimate > job.deadline_ms:
            self.refusals["deadline_unmeetable"] += 1
            retry = max(1, math.ceil((estimate - job.deadline_ms) / 1e3))
            raise ApiError(503, f"the first audio would come in about {estimate:.0f} ms, after the "
                           f"{job.deadline_ms:g} ms deadline; retry in {retry} s", "ttfa_deadline_ms",
                           "deadline_unmeetable", retry_after_s=retry)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "voices": sorted(self.voices),
            "formats": formats.available(self.formats),
            "refusals": dict(self.refusals),
            "chains": {name: chain.stats() for name, chain in self.chains.items()},
        }

    def close(self) -> None:
        self.closing = True  # requests from now on: 503 server_shutting_down
        for chain in self.chains.values():
            chain.close()


def bearer_authorized(header: str | None, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <api_key>`` (compared in constant time); always
    true without a key."""
    if api_key is None:
        return True
    import hmac

    scheme, _, key = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())


def _check_text(name: str, value: str) -> None:
    """400 for text no voice can speak and no log can print: NUL characters, lone surrogates."""
    if "\x00" in value:
        raise ApiError(400, f"{name}: contains a NUL character", name, "invalid_text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{name}: not valid Unicode text ({exc.reason} at {exc.start})", name,
                       "invalid_text") from None


def _speed(value: Any) -> float:
    try:
        speed = float(value)
    except OverflowError:
        speed = math.inf
    if not (math.isfinite(speed) and 0.25 <= speed <= 4.0):
        raise ApiError(422, f"speed {value!r} is outside [0.25, 4.0]", "speed", "invalid_value")
    return speed


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    try:
        deadline = float(value)
    except OverflowError:
        deadline = math.inf
    if not (math.isfinite(deadline) and deadline > 0):
        raise ApiError(422, f"ttfa_deadline_ms {value!r} must be a positive number of ms", "ttfa_deadline_ms",
                       "invalid_value")
    return deadline


def _seed(value: Any) -> int | None:
    if value is not None and not 0 <= value <= SEED_MAX:
        raise ApiError(422, f"seed {value} is outside [0, {SEED_MAX}]", "seed", "invalid_value")
    return value


def _error(exc: ApiError, retry_after_s: int = 1):
    from starlette.responses import JSONResponse

    retry = exc.retry_after_s if exc.retry_after_s is not None else retry_after_s
    headers = {"Retry-After": str(retry)} if exc.status == 503 else None
    body = {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error" if exc.status < 500 else "server_error",
            "param": exc.param,
            "code": exc.code,
        }
    }
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _read_body(request: Any, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds {limit}", code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    return bytes(body)


class StreamCut(Exception):
    """A streamed response whose request ended before its audio did: the connection is dropped without
    the chunked body's end, so no client takes the audio so far for the whole utterance."""


async def _whole_file(head: bytes, chunks: AsyncIterator[Any], encoder: Any, finished: Any,
                      handle: Any) -> Any:
    """A WAV or FLAC file with its true length (one response once the utterance is done): readers that
    trust the header (Python's `wave`, libsndfile) get the right duration. A failure after the first chunk
    is a 500; a request cut short by the server shutting down a 503 (never a short file)."""
    from starlette.responses import Response

    parts = [head]
    try:
        async for chunk in chunks:
            parts.append(encoder(chunk))
        if handle.state == "cancelled":
            return _error(ApiError(503, "the server is shutting down; retry", code="server_shutting_down"))
        parts.append(encoder.end())
    except StageError as exc:
        return _error(ApiError(500, f"synthesis failed: {exc.original}", code="server_error"))
    finally:
        await chunks.aclose()
        finished()
    return Response(encoder.whole(b"".join(parts)), media_type=encoder.fmt.media_type,
                    headers={"X-Sample-Rate": str(encoder.rate)})


async def _cancel_on_disconnect(request: Any, handle: Any) -> None:
    """Cancel `handle` the moment the client hangs up (the body was read: the next message on the
    connection is its ``http.disconnect``), not when the next chunk's write fails."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            handle.cancel()
            return


def build_app(server: SpeechServer):
    """The Starlette application of `server` (routes of the module docstring)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def speech(request):
        arrived, job = time.perf_counter(), None
        try:
            if not server.authorized(request.headers.get("authorization")):
                raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
            job = server.parse(await _read_body(request, server.limits.max_body_bytes))
            head, chunks, handle, encoder = await server.speak(job)
        except ApiError as exc:
            server.answered(job.voice if job else "", exc.status, exc.code)
            return _error(exc, server.limits.retry_after_s)
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, handle))
        if server.metrics is not None:
            server.metrics.ttfa.labels(job.voice).observe(time.perf_counter() - arrived)

        def finished() -> None:
            watcher.cancel()
            handle.cancel()  # a disconnect lands here too: every stage stops
            encoder.close()
            server.answered(job.voice, 200, "" if handle.state == "done" else handle.state)
            if server.metrics is not None:
                server.metrics.total.labels(job.voice).observe(time.perf_counter() - arrived)

        if not encoder.fmt.streamed:
            return await _whole_file(head, chunks, encoder, finished, handle)

        async def body():
            try:
                yield head
                async for chunk in chunks:
                    yield encoder(chunk)
                if handle.state != "done":  # cut short (the server is shutting down): no clean end, so
                    raise StreamCut(handle.state)  # the client sees a broken stream, not a short one
                yield encoder.end()
            except SlowConsumer:
                return  # the client stopped reading: its request is gone, the response ends here
            finally:
                await chunks.aclose()
                finished()

        return StreamingResponse(body(), media_type=encoder.fmt.media_type,
                                 headers={"X-Sample-Rate": str(encoder.rate)})

    async def models(request):
        if not server.authorized(request.headers.get("authorization")):
            return _error(ApiError(401, "Incorrect API key provided", code="invalid_api_key"))
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "flashrt"} for name in server.voices
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(request):
        return JSONResponse(server.health())

    async def metrics(request):
        if server.metrics is None:
            return _error(ApiError(501, "metrics need the prometheus_client package (pip install "
                                   "'flashrt[serve]')", code="not_implemented"))
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    async def unexpected(request, exc):
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", code="server_error"))

    return Starlette(
        exception_handlers={Exception: unexpected},
        routes=[
            Route("/v1/audio/speech", speech, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )
