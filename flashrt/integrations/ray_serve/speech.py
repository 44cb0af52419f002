"""The speech deployments: `LMStage` (SNAC code chunks), `VocoderStage` (their audio, the windows of
the requests a replica streams decoded together) and `SpeechIngress` (`flashrt serve`'s routes and
checks, with its own admission)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashrt.errors import InputError
from flashrt.integrations.ray_serve.apps import set_threads
from flashrt.integrations.ray_serve.batcher import Batcher

VOCODER_OPTIONS = ("device", "backend", "stream_chunk", "snac_noise", "slots")  # `load_snac`'s options


class LMStage:
    """The lm stage of an Orpheus-style voice: streams each request's SNAC code chunks."""

    def __init__(self, folder: str, options: dict[str, Any], limits: Any, threads: int) -> None:
        from flashrt.runner.orpheus import load_orpheus

        set_threads(threads)
        self.tts = load_orpheus(folder, vocoder=False, **options)
        self.chain = self.tts.serving_chain(queue_size=limits.queue_size, max_pending=limits.max_pending,
                                            send_timeout_s=limits.send_timeout_s)

    def info(self) -> dict[str, Any]:
        return {"sample_rate": self.tts.sample_rate, "speakers": tuple(self.tts.speakers)}

    async def codes(self, text: str, speaker: str | None, seed: int | None, speed: float):
        """(codes, last) per chunk: codes a tuple of SNAC code tensors (None: none), last on the last."""
        extra = {"voice": speaker} if speaker else {}
        request = self.chain.submit(self.tts.request(text, seed=seed, speed=speed, **extra))
        try:
            async for item in request:
                yield item.codes, item.last
            if request.state != "done":  # the chain closed under it: an error, never a clean short end
                raise RuntimeError(f"the lm stage ended request {request.id!r} early ({request.state})")
        finally:
            request.cancel()

    def check_health(self) -> None:
        if self.chain._closed:
            raise RuntimeError("the lm chain is closed")


class VocoderStage:
    """The snac stage: a request's audio, decoded from the code chunks an lm replica streams.

    The requests a replica streams share its one decode worker as the single-process chain's batched
    snac stage does: each chunk a request receives is a step (`_window`); the steps waiting when the
    worker comes free are taken together (never waiting for more: no latency is added), each fed into
    its own request's SNAC stream, and the windows due in all of them decoded with one
    `StreamRunner.decode_together` (windows of one length stacked as rows of one replay, where the
    vocoder stacks: seeded SNAC noise decodes one row each). Serve's ``@serve.batch`` is not used: it
    would add a wait and a second batching layer over this one. `rounds` counts the steps taken per
    decode. A batch that fails is decoded again one request at a time, so a failure is its request's."""

    def __init__(self, folder: str, options: dict[str, Any], threads: int, lm: Any) -> None:
        from flashrt.frontends.orpheus.folder import snac_folder
        from flashrt.runner.orpheus import load_snac

        set_threads(threads)
        given = {k: options[k] for k in VOCODER_OPTIONS if k in options}
        self.vocoder, self.stack = load_snac(snac_folder(Path(folder), options.get("snac")), **given)
        self.lm = lm
        self.batcher = Batcher(self._decode_steps, None, "snac")  # one decode at a time

    @property
    def rounds(self) -> Counter[int]:
        """Steps per decode (`Batcher.rounds`)."""
        return self.batcher.rounds

    async def audio(self, text: str, speaker: str | None, seed: int | None, speed: float):
        """float32 audio chunks of one request, as the single-process chain's snac stage makes them."""
        stream = self.vocoder.open()
        chunks = self.lm.codes.options(stream=True).remote(text, speaker, seed, speed)
        ended = False
        try:
            async for codes, last in chunks:
                audio = await self._window(stream, codes, last)
                ended = ended or last
                if audio is not None:
                    yield audio
            if not ended:  # the lm's stream stopped before its last chunk: an error, not a short utterance
                raise RuntimeError("the lm stage's stream ended before the utterance's last chunk")
        finally:
            chunks.cancel()

    async def _window(self, stream: Any, codes: Any, last: bool) -> np.ndarray | None:
        """One step of one request (its chunk in, the audio it completes out), decoded with the steps
        of the other requests waiting for the worker."""
        return await self.batcher((stream, codes, last))

    def _decode(self, stream: Any, codes: Any, last: bool) -> np.ndarray | None:
        """One request's step alone (`_decode_steps` of one)."""
        (out,) = self._decode_steps([(stream, codes, last)])
        if isinstance(out, BaseException):
            raise out
        return out

    def _decode_steps(self, steps: list[tuple[Any, Any, bool]]) -> list[Any]:
        """Each step's audio (None: none yet), or the exception that ended its request."""
        outs: list[Any] = [None] * len(steps)
        live = []
        for k, (stream, codes, last) in enumerate(steps):
            try:
                if codes is not None:
                    stream.feed(codes)
                if last:
                    stream.finish()
                live.append(k)
            except Exception as exc:  # noqa: BLE001 - a bad chunk ends its own request
                outs[k] = exc
        try:
            self.vocoder.decode_together([steps[k][0] for k in live], stack=self.stack)
        except Exception:  # noqa: BLE001 - again one by one: the audio already read stays its stream's
            for k in live:
                try:
                    self.vocoder.decode_together([steps[k][0]], stack=self.stack)
                except Exception as exc:  # noqa: BLE001
                    outs[k] = exc
        for k in live:
            if outs[k] is None:
                outs[k] = _take(steps[k][0])
        return outs

    def check_health(self) -> None:
        self.batcher.check_health()


def _take(stream: Any) -> np.ndarray | None:
    """The mono audio a SNAC stream has ready (None: none)."""
    from flashrt.frontends.orpheus.tts import _mono

    audio = stream.take()
    return np.concatenate([_mono(a) for a in audio]) if audio else None


@dataclass(frozen=True)
class _Voice:
    """What the request checks need of a voice served elsewhere."""

    sample_rate: int
    speakers: tuple[str, ...]


def _checks(voices: dict[str, _Voice], limits: Any) -> Any:
    """`flashrt serve`'s request checks (`SpeechServer.parse`) over voices that are served elsewhere:
    a SpeechServer without chains of its own."""
    from flashrt.serve.app import SpeechServer
    from flashrt.serve.formats import FORMATS

    class Checks(SpeechServer):
        def __init__(self) -> None:  # noqa: D107 - no chains, no metrics: only the checks
            self.voices, self.limits, self.formats, self.api_key = dict(voices), limits, dict(FORMATS), None

    return Checks()


def _cause(exc: BaseException) -> BaseException:
    """The exception a remote stage raised, out of Ray's wrappers (RayTaskError.cause, nested)."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 8:
        exc, seen = exc.cause, seen + 1
    return exc


def _api_error(exc: BaseException) -> Any:
    """The `flashrt serve` error of a failed speech request (InputError 400, a full chain or Serve's
    back-pressure 503, anything else 500)."""
    from flashrt.chain import ChainFull, StageError
    from flashrt.serve.app import ApiError

    cause = _cause(exc)
    if isinstance(cause, StageError):
        cause = cause.original
    if isinstance(cause, InputError):
        return ApiError(400, str(cause), "input", "invalid_input")
    if isinstance(cause, ChainFull) or type(cause).__name__ == "BackPressureError":
        return ApiError(503, f"busy: {cause}", code="server_busy")
    return ApiError(500, f"synthesis failed: {type(cause).__name__}: {cause}", code="server_error")


class _Admission:
    """The speech requests an ingress replica holds at once (a streamed one until its body ends); one
    beyond ``limit`` is refused before any work (`take`: 503 ``server_busy``). The replica's requests
    run on its one event loop: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = int(limit), 0

    def take(self) -> Any:
        """A slot (its release, idempotent), or ApiError 503 when ``limit`` are held."""
        from flashrt.serve.app import ApiError

        if self.held >= self.limit:
            raise ApiError(503, f"busy: {self.held} requests held by this replica (limit {self.limit}); "
                           "retry", code="server_busy")
        self.held += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= 1

        return release


class SpeechIngress:
    """POST /v1/audio/speech (and GET /v1/models, /health) over the voices' vocoder deployments; it
    admits ``admit`` speech requests at once (`_Admission`) and refuses the others at once. With
    ``api_key`` every ``/v1/`` route wants ``Authorization: Bearer <key>`` (401 ``invalid_api_key``
    otherwise, before any work), as `flashrt serve --api-key`; /health stays open."""

    def __init__(self, lms: dict[str, Any], vocoders: dict[str, Any], limits: Any, admit: int,
                 api_key: str | None = None) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("an API key must not be empty")
        self.lms, self.vocoders, self.limits, self.api_key = lms, vocoders, limits, api_key
        self.admission = _Admission(admit)
        self.checks: Any = None

    async def _checks(self) -> Any:
        if self.checks is None:
            voices = {name: _Voice(**await lm.info.remote()) for name, lm in self.lms.items()}
            self.checks = _checks(voices, self.limits)
        return self.checks

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from flashrt.serve.app import ApiError, _error, bearer_authorized

        path, method = request.url.path.rstrip("/"), request.method  # under the app's route prefix
        if "/v1/" in path + "/" and not bearer_authorized(request.headers.get("authorization"), self.api_key):
            return _error(ApiError(401, "Incorrect API key provided", code="invalid_api_key"))
        if path.endswith("/v1/audio/speech") and method == "POST":
            return await self._speech(request)
        if path.endswith("/v1/models") and method == "GET":
            data = [{"id": name, "object": "model", "created": 0, "owned_by": "flashrt"} for name in self.lms]
            return JSONResponse({"object": "list", "data": data})
        if path.endswith("/health") and method == "GET":
            return JSONResponse({"status": "ok", "voices": sorted(self.lms)})
        return _error(ApiError(404, f"no route {method} {path}", code="not_found"))

    async def _speech(self, request: Any) -> Any:
        from flashrt.serve.app import ApiError, _error

        try:
            release = self.admission.take()
        except ApiError as exc:  # refused before any work, in OpenAI's shape with Retry-After
            return _error(exc, self.limits.retry_after_s)
        handed = False
        try:
            response, handed = await self._admitted(request, release)
            return response
        finally:
            if not handed:  # answered (or failed) here: a streamed body releases its slot when it ends
                release()

    async def _admitted(self, request: Any, release: Any) -> tuple[Any, bool]:
        """(response, whether a streamed body now holds the request's slot)."""
        from flashrt.serve import formats
        from flashrt.serve.app import ApiError, _error, _read_body

        try:
            checks = await self._checks()
            job = checks.parse(await _read_body(request, self.limits.max_body_bytes))
            chunks = self.vocoders[job.voice].audio.options(stream=True).remote(
                job.text, job.speaker, job.seed, job.speed)
            first = await self._first(chunks)
        except ApiError as exc:
            return _error(exc, self.limits.retry_after_s), False
        encoder = formats.encoder(checks.formats[job.fmt], checks.voices[job.voice].sample_rate)
        if not encoder.fmt.streamed:
            return await self._whole(first, chunks, encoder), False
        return self._streamed(first, chunks, encoder, release), True

    @staticmethod
    async def _first(chunks: Any) -> np.ndarray:
        from flashrt.serve.app import ApiError

        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            raise ApiError(400, "nothing to say", "input", "empty_audio") from None
        except Exception as exc:  # noqa: BLE001 - every remote failure answers in OpenAI's shape
            chunks.cancel()
            raise _api_error(exc) from None

    @staticmethod
    async def _whole(first: np.ndarray, chunks: Any, encoder: Any) -> Any:
        from starlette.responses import Response

        from flashrt.serve.app import _error

        parts = [encoder.head(), encoder(first)]
        try:
            async for chunk in chunks:
                parts.append(encoder(chunk))
            parts.append(encoder.end())
        except Exception as exc:  # noqa: BLE001 - a failure before the answer is a 500, not a cut file
            return _error(_api_error(exc))
        finally:
            chunks.cancel()
            encoder.close()
        return Response(encoder.whole(b"".join(parts)), media_type=encoder.fmt.media_type,
                        headers={"X-Sample-Rate": str(encoder.rate)})

    @staticmethod
    def _streamed(first: np.ndarray, chunks: Any, encoder: Any, release: Any) -> Any:
        """The streamed answer; it holds the request's admission slot until its body ends (or, never
        started, e.g. the client gone first, until it is collected)."""
        import weakref

        from starlette.responses import StreamingResponse

        async def body():
            try:
                yield encoder.head() + encoder(first)
                async for chunk in chunks:  # a failure here propagates: the response is cut short
                    yield encoder(chunk)
                yield encoder.end()
            finally:
                chunks.cancel()
                encoder.close()
                release()

        stream = body()
        weakref.finalize(stream, release)
        return StreamingResponse(stream, media_type=encoder.fmt.media_type,
                                 headers={"X-Sample-Rate": str(encoder.rate)})
