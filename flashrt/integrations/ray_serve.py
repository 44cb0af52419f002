"""flashrt on Ray Serve: the speech chain split at its stage boundary, and policies, as Serve deployments.

    from flashrt.integrations.ray_serve import deploy_speech, deploy_policy, SpeechApp, StageScale
    deploy_speech(SpeechApp("orpheus_dir", lm=StageScale(replicas=2), vocoder=StageScale(replicas=1)))
    # POST http://127.0.0.1:8000/v1/audio/speech   (Serve's HTTP proxy; as `flashrt serve`)
    deploy_policy(PolicyApp("policy_dir"))
    # ws://127.0.0.1:8000/ (openpi-client), POST http://127.0.0.1:8000/infer (msgpack in and out)

Speech (an Orpheus-style voice, `flashrt.frontends.orpheus`) runs as three deployments, each with its own
replica count, resources and ``max_ongoing_requests`` (`StageScale`):

    lm       `load_orpheus(..., vocoder=False)`: the model's own LM stage (its SlotDecoder, the requests
             of a replica decoding together as rows), a generator method streaming SNAC code chunks
    vocoder  `load_snac` (as `load_orpheus` loads it): streams a request's audio, pulling its code chunks
             from an lm replica (``handle.options(stream=True)``) into the request's SNAC stream
             (exact overlap windows: the chunks concatenate to what the single-process chain makes);
             the windows due in the requests a replica streams are decoded together, stacked as rows
             of one replay, as the single-process snac stage does (`VocoderStage`)
    ingress  POST /v1/audio/speech, GET /v1/models, GET /health: the request checks and error shapes
             of `flashrt serve` (`flashrt.serve.app.SpeechServer.parse`, its ``{"error": ...}`` body)

So the audio of a request and seed is the one `flashrt serve` sends (each replica sets torch's thread
count, `StageScale.threads`: float reductions, hence bits, depend on it). A replica loads and captures
its graphs in its constructor, so Serve reports it not ready and routes nothing to it before that; it
replays from then on; its ``check_health`` fails once its chain or worker is closed, so Serve replaces
it. A replica that dies mid-request ends that request with an error: before the first chunk a 500 in
OpenAI's shape, after it the response is cut short (the client's read fails: never a clean end of a
truncated stream); Serve restarts the replica and the next request is served. Back-pressure, refused at
once, never queued without bound: an ingress replica admits ``ingress.max_ongoing_requests`` speech
requests (a streamed one until its body ends) and answers the others `flashrt serve`'s 503
(``server_busy``, OpenAI's error shape, Retry-After); Serve hands it `REFUSAL_HEADROOM` times that many,
so its own refusals are the ones clients see, and queues ``max_queued_requests`` more for it while it
routes a burst (beyond: Serve's own 503, text, with Retry-After where its ``backpressure_config``
exists). Behind it the vocoder and lm deployments hold ``max_ongoing_requests`` per replica and queue
``max_queued_requests`` (beyond: 503 ``server_busy``), and each lm replica's chain refuses beyond
``max_pending`` (503 ``server_busy``).

Policies (`PolicyApp`): one ASGI deployment (`PolicyIngress`), `load_policy` inside each replica: the
openpi websocket protocol of `flashrt serve-policy` on any path of the application (metadata first, then
msgpack observations, ``seed``/``noise`` keys as there, answered with msgpack ``{"actions",
"policy_timing", "server_timing"}`` or a text error), and POST /infer (one observation, the same reply,
or a JSON error (`flashrt.serve.policy_server.error_reply`): 400 a refused request, 500 a bug). The
requests waiting for a replica's worker run together (`Policy.infer_batch`) where it loaded batch
buckets.

Scale: a `StageScale` with ``max_replicas`` autoscales (Serve's ``autoscaling_config``); `serve_config`
writes Serve's own YAML (the builder's ``args`` and each deployment's options) for ``serve deploy``.

Ray is optional (``pip install 'flashrt[ray]'``) and imported only when a deployment is built.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from flashrt.errors import ConfigError, FlashRTError, InputError

__all__ = ["StageScale", "SpeechApp", "PolicyApp", "speech_app", "policy_app", "deploy_speech",
           "deploy_policy", "LMStage", "VocoderStage", "SpeechIngress", "PolicyIngress", "parse_replicas",
           "parse_count", "serve_config", "speech_deployments", "policy_deployments", "speech_builder",
           "policy_builder", "serve_command", "policy_command", "check_fits", "STAGES"]

STAGES = ("lm", "vocoder", "ingress")  # the deployments of a SpeechApp, as --replicas names them

REFUSAL_HEADROOM = 4  # an ingress replica takes this many times the speech requests it admits (speech_app)
VOCODER_OPTIONS = ("device", "backend", "stream_chunk", "snac_noise", "slots")  # `load_snac`'s options


@dataclass(frozen=True)
class StageScale:
    """One deployment's scale: replicas, resources per replica, requests a replica holds at once and
    requests the deployment queues beyond them (then Serve refuses with a 503). With ``max_replicas``
    above ``replicas`` the deployment autoscales between them (Serve's ``autoscaling_config``: it
    starts at ``replicas`` and adds replicas while they hold more than ``target_ongoing_requests``
    each)."""

    replicas: int = 1
    max_replicas: int | None = None  # None: always ``replicas``
    target_ongoing_requests: float = 2.0  # what autoscaling aims a replica holds (Serve's default)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 8
    max_queued_requests: int = 16
    threads: int | None = None  # torch's intra-op threads in a replica (None: num_cpus, at least 1)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_ongoing_requests < 1 or self.max_queued_requests < 0:
            raise ConfigError(f"{self}: replicas and max_ongoing_requests must be >= 1, "
                              "max_queued_requests >= 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"{self}: threads must be >= 1")
        if self.max_replicas is not None and self.max_replicas < self.replicas or \
                not self.target_ongoing_requests > 0:
            raise ConfigError(f"{self}: max_replicas must be >= replicas, target_ongoing_requests > 0")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError(f"{self}: resources must not be negative")

    @property
    def torch_threads(self) -> int:
        """Set in each replica before it loads: a float reduction's result depends on the thread count,
        so a replica matches (bit for bit) a process run with the same count."""
        return self.threads if self.threads is not None else max(1, int(self.num_cpus))

    @property
    def autoscales(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscales else self.replicas

    def deployment_options(self) -> dict[str, Any]:
        """Serve's options of the deployment (``serve.deployment(**options)``, and a Serve config's
        deployment entry): a fixed ``num_replicas``, or an ``autoscaling_config``."""
        count: dict[str, Any] = {"num_replicas": self.replicas}
        if self.autoscales:
            count = {"autoscaling_config": {"min_replicas": self.replicas, "initial_replicas": self.replicas,
                                            "max_replicas": self.max_replicas,
                                            "target_ongoing_requests": self.target_ongoing_requests}}
        return {**count, "max_ongoing_requests": self.max_ongoing_requests,
                "max_queued_requests": self.max_queued_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}


@dataclass(frozen=True)
class SpeechApp:
    """An Orpheus-style voice served on Ray: its folder, the voice's name, `load_orpheus` options
    (device, precision, max_new_tokens, sampling, ...), the scale of each stage, the server's limits
    (`flashrt.serve.app.ServerLimits`; None: its defaults)."""

    folder: str
    name: str = "orpheus"
    options: dict[str, Any] = field(default_factory=dict)
    lm: StageScale = StageScale()
    vocoder: StageScale = StageScale(num_cpus=0.5)
    ingress: StageScale = StageScale(num_cpus=0.25, max_ongoing_requests=64, max_queued_requests=64)
    limits: Any = None


    def args(self) -> dict[str, Any]:
        """This app as the plain ``args`` of a Serve config (`speech_builder` rebuilds it)."""
        from dataclasses import asdict

        from flashrt.serve.app import ServerLimits

        return {"folder": str(self.folder), "name": self.name, "options": dict(self.options),
                **{stage: asdict(getattr(self, stage)) for stage in STAGES},
                "limits": asdict(self.limits or ServerLimits())}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> SpeechApp:
        from flashrt.serve.app import ServerLimits

        unknown = sorted(set(args) - {"folder", "name", "options", "limits", *STAGES})
        if unknown or "folder" not in args:
            raise ConfigError(f"speech app args: unknown {unknown} or no 'folder' (args: {sorted(args)})")
        scales = {stage: StageScale(**args[stage]) for stage in STAGES if stage in args}
        limits = ServerLimits(**args["limits"]) if "limits" in args else None
        return cls(str(args["folder"]), args.get("name", "orpheus"), dict(args.get("options", {})),
                   limits=limits, **scales)


@dataclass(frozen=True)
class PolicyApp:
    """A policy served on Ray: its checkpoint folder, `load_policy` options, the deployment's scale."""

    folder: str
    options: dict[str, Any] = field(default_factory=dict)
    scale: StageScale = StageScale()

    def args(self) -> dict[str, Any]:
        """This app as the plain ``args`` of a Serve config (`policy_builder` rebuilds it)."""
        from dataclasses import asdict

        return {"folder": str(self.folder), "options": dict(self.options), "scale": asdict(self.scale)}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> PolicyApp:
        unknown = sorted(set(args) - {"folder", "options", "scale"})
        if unknown or "folder" not in args:
            raise ConfigError(f"policy app args: unknown {unknown} or no 'folder' (args: {sorted(args)})")
        scale = StageScale(**args["scale"]) if "scale" in args else StageScale()
        return cls(str(args["folder"]), dict(args.get("options", {})), scale)


# ------------------------------------------------------------------------------------------ speech

def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class LMStage:
    """The lm stage of an Orpheus-style voice: streams each request's SNAC code chunks."""

    def __init__(self, folder: str, options: dict[str, Any], limits: Any, threads: int) -> None:
        from flashrt.runner.orpheus import load_orpheus

        _set_threads(threads)
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
        from collections import Counter

        from flashrt.frontends.orpheus.folder import snac_folder
        from flashrt.runner.orpheus import load_snac

        _set_threads(threads)
        given = {k: options[k] for k in VOCODER_OPTIONS if k in options}
        self.vocoder, self.stack = load_snac(snac_folder(Path(folder), options.get("snac")), **given)
        self.lm = lm
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="snac")  # one decode at a time
        self.waiting: list[tuple[Any, Any, bool, asyncio.Future]] = []
        self.drainer: asyncio.Task | None = None
        self.rounds: Counter[int] = Counter()

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
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((stream, codes, last, future))
        if self.drainer is None or self.drainer.done():
            self.drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            steps, self.waiting = [s for s in self.waiting if not s[3].done()], []
            if not steps:
                continue
            self.rounds[len(steps)] += 1
            try:
                outs = await loop.run_in_executor(self.worker, self._decode_steps, [s[:3] for s in steps])
            except BaseException as exc:  # the worker gone (replica shutting down): every step says so
                outs = [exc] * len(steps)
            for (*_, future), out in zip(steps, outs):
                if not future.done():
                    future.set_exception(out) if isinstance(out, BaseException) else future.set_result(out)

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
        if self.worker._shutdown:
            raise RuntimeError("the snac worker is shut down")


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
    admits ``admit`` speech requests at once (`_Admission`) and refuses the others at once."""

    def __init__(self, lms: dict[str, Any], vocoders: dict[str, Any], limits: Any, admit: int) -> None:
        self.lms, self.vocoders, self.limits = lms, vocoders, limits
        self.admission = _Admission(admit)
        self.checks: Any = None

    async def _checks(self) -> Any:
        if self.checks is None:
            voices = {name: _Voice(**await lm.info.remote()) for name, lm in self.lms.items()}
            self.checks = _checks(voices, self.limits)
        return self.checks

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from flashrt.serve.app import ApiError, _error

        path, method = request.url.path.rstrip("/"), request.method  # under the app's route prefix
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


# ------------------------------------------------------------------------------------------ policy

class PolicyIngress:
    """A policy's routes at its application's root (a Serve ASGI ingress, `policy_app`):

        websocket      the openpi protocol of `flashrt serve-policy` (`flashrt.serve.policy_server`): the
                       metadata map first, then each binary msgpack observation answered with msgpack
                       ``{"actions", "policy_timing", "server_timing"}`` or a text error; an internal
                       error closes the connection with 1011, every other error keeps it
        POST /infer    one observation -> the same msgpack reply, or the error as JSON (400 / 500)
        GET /health    the policy's metadata

    One worker thread runs the policy (the only caller of it, as in `flashrt serve-policy`). A policy
    loaded with batch buckets (``options["batches"]``, `flashrt serve-policy --ray --max-batch`) serves
    the requests waiting for the worker when it comes free together, up to `Policy.max_batch`, with one
    `Policy.infer_batch` (each request checked alone, its own actions, its own error); a lone request runs
    exactly as `Policy.infer`. No window is waited for more; `rounds` counts requests per run."""

    def __init__(self, folder: str, options: dict[str, Any], threads: int) -> None:
        from collections import Counter

        from flashrt.runner.policy import load_policy
        from flashrt.serve.policy_server import message_limit, policy_metadata
        from flashrt.serve.wire import packb

        _set_threads(threads)
        self.policy = load_policy(folder, **options)
        self.max_bytes = message_limit(self.policy)
        self.hello = packb(policy_metadata(self.policy))
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="policy")
        self.waiting: list[tuple[Any, asyncio.Future]] = []
        self.drainer: asyncio.Task | None = None
        self.rounds: Counter[int] = Counter()

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app (Serve calls this once the replica is constructed): a websocket on any path of
        the application (as `flashrt serve-policy` takes any), the HTTP routes by path."""
        from starlette.applications import Starlette
        from starlette.routing import Route
        from starlette.websockets import WebSocket

        http = Starlette(routes=[Route("/infer", self._http_infer, methods=["POST"]),
                                 Route("/health", self._health, methods=["GET"])])

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "websocket":
                return await self._websocket(WebSocket(scope, receive, send))
            return await http(scope, receive, send)

        return app

    async def _http_infer(self, request: Any) -> Any:
        from starlette.responses import Response

        status, body = await self._answer(await request.body(), None)
        kind = "application/msgpack" if status == 200 else "application/json"
        return Response(body, status_code=status, media_type=kind)

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from flashrt.serve.policy_server import _no_paths, policy_metadata

        return JSONResponse({"status": "ok", "policy": _no_paths(policy_metadata(self.policy))})

    async def _websocket(self, ws: Any) -> None:
        """One openpi client: metadata, then requests answered in turn (`flashrt serve-policy`'s replies)."""
        import time

        from starlette.websockets import WebSocketDisconnect

        from flashrt.serve.policy_server import CLOSE_INTERNAL_ERROR

        await ws.accept()
        try:
            await ws.send_bytes(self.hello)
            prev_total_ms = None
            while (message := await ws.receive())["type"] != "websocket.disconnect":
                start = time.perf_counter()
                data = message.get("bytes")
                status, reply = await self._answer(data if data is not None else message.get("text"),
                                                      prev_total_ms)
                await (ws.send_bytes(reply) if isinstance(reply, bytes) else ws.send_text(reply))
                if status == 500:
                    await ws.close(CLOSE_INTERNAL_ERROR, "internal server error")
                    return
                prev_total_ms = (time.perf_counter() - start) * 1e3
        except WebSocketDisconnect:
            return

    async def _answer(self, message: Any, prev_total_ms: float | None) -> tuple[int, bytes | str]:
        """(status, reply): msgpack actions, or an error reply (400 refused, 500 a bug)."""
        import time

        from flashrt.serve.policy_server import INTERNAL_ERROR, _request_of, error_code, error_reply
        from flashrt.serve.wire import WireError, coerce, packb, unpackb

        start = time.perf_counter()
        try:
            out = await self._infer(_request_of(coerce(unpackb(message, self.max_bytes))))
        except (WireError, FlashRTError) as exc:
            return 400, error_reply(error_code(exc), type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug answers 500; the replica keeps serving
            return 500, error_reply(INTERNAL_ERROR, type(exc).__name__, f"internal error: {exc}")
        infer_ms = (time.perf_counter() - start) * 1e3
        timing = {k: float(v) for k, v in out.get("timing", {}).items()}
        server: dict[str, Any] = {"infer_ms": infer_ms, "batch": int(out.get("rows", 1))}
        if prev_total_ms is not None:
            server["prev_total_ms"] = prev_total_ms
        return 200, packb({"actions": out["actions"], "policy_timing": timing, "server_timing": server})

    async def _infer(self, request: Any) -> dict[str, Any]:
        """`request`'s result (its error raised), run with the other requests waiting for the worker."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((request, future))
        if self.drainer is None or self.drainer.done():
            self.drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            live = [item for item in self.waiting if not item[1].done()]
            taken, self.waiting = live[:self.policy.max_batch], live[self.policy.max_batch:]
            if not taken:
                continue
            self.rounds[len(taken)] += 1
            try:
                outs = await loop.run_in_executor(self.worker, self._run, [r for r, _ in taken])
            except BaseException as exc:  # the worker gone (replica shutting down): every request says so
                outs = [exc] * len(taken)
            for (_, future), out in zip(taken, outs):
                if not future.done():
                    future.set_exception(out) if isinstance(out, BaseException) else future.set_result(out)

    def _run(self, requests: list[Any]) -> list[Any]:
        """Each request's result or exception: one alone exactly as `Policy.infer`, several with one
        `Policy.infer_batch`."""
        if len(requests) > 1:
            return self.policy.infer_batch(requests)
        request = requests[0]
        try:
            return [self.policy.infer(request.obs, noise=request.noise, seed=request.seed)]
        except Exception as exc:  # noqa: BLE001 - the request's own error, answered to it
            return [exc]

    def check_health(self) -> None:
        if self.worker._shutdown:
            raise RuntimeError("the policy worker is shut down")


# ------------------------------------------------------------------------------------------ building

def _serve() -> Any:
    from ray import serve  # the `ray` extra; a missing one is named by `flashrt.extras`

    return serve


def speech_deployments(app: SpeechApp) -> dict[str, dict[str, Any]]:
    """{deployment name: Serve options} of `app`'s stages: what `speech_app` deploys and what a Serve
    config (`serve_config`) lists under ``deployments``."""
    from flashrt.serve.app import ServerLimits

    limits = app.limits or ServerLimits()
    # Serve hands an ingress replica REFUSAL_HEADROOM x the requests it admits, so the ones beyond are
    # refused by it (OpenAI's 503 body, Retry-After) rather than by Serve's proxy (its own text 503)
    ingress = {**app.ingress.deployment_options(), **_backpressure(_serve(), limits.retry_after_s),
               "max_ongoing_requests": REFUSAL_HEADROOM * app.ingress.max_ongoing_requests}
    return {f"{app.name}-lm": app.lm.deployment_options(),
            f"{app.name}-vocoder": app.vocoder.deployment_options(), "speech": ingress}


def speech_app(app: SpeechApp) -> Any:
    """The Serve application of `app` (lm -> vocoder -> ingress), not yet running."""
    from flashrt.serve.app import ServerLimits

    serve, limits = _serve(), app.limits or ServerLimits()
    (lm_name, lm_options), (vocoder_name, vocoder_options), (_, ingress_options) = \
        speech_deployments(app).items()
    lm = serve.deployment(LMStage, name=lm_name, **lm_options)
    vocoder = serve.deployment(VocoderStage, name=vocoder_name, **vocoder_options)
    ingress = serve.deployment(SpeechIngress, name="speech", **ingress_options)
    lm_bound = lm.bind(str(app.folder), dict(app.options), limits, app.lm.torch_threads)
    vocoder_bound = vocoder.bind(str(app.folder), dict(app.options), app.vocoder.torch_threads, lm_bound)
    return ingress.bind({app.name: lm_bound}, {app.name: vocoder_bound}, limits,
                        app.ingress.max_ongoing_requests)


def policy_deployments(app: PolicyApp) -> dict[str, dict[str, Any]]:
    """{deployment name: Serve options} of `app` (one deployment, "policy")."""
    return {"policy": app.scale.deployment_options()}


def _backpressure(serve: Any, retry_after_s: float) -> dict[str, Any]:
    """Serve's own refusals (beyond a deployment's ``max_queued_requests``) with a Retry-After header,
    where this Ray's Serve has ``backpressure_config`` (newer than the oldest Ray 2 flashrt takes)."""
    import inspect

    if "backpressure_config" in inspect.signature(serve.deployment).parameters:
        return {"backpressure_config": {"retry_after_s": retry_after_s}}
    return {}


def policy_app(app: PolicyApp) -> Any:
    """The Serve application of `app` (one ASGI ingress deployment: websocket and HTTP routes)."""
    serve = _serve()
    ingress = serve.ingress()(PolicyIngress)  # its routes built in each replica (__serve_build_asgi_app__)
    return serve.deployment(ingress, name="policy", **policy_deployments(app)["policy"]).bind(
        str(app.folder), dict(app.options), app.scale.torch_threads)


def check_fits(scales: list[StageScale], available: dict[str, float]) -> None:
    """ConfigError when the replicas of `scales` together (an autoscaling one at its most) need more
    CPUs or GPUs than `available` (``ray.cluster_resources()``, the cluster's total): Serve would wait
    for them forever."""
    for key, need in (("CPU", sum(s.most_replicas * s.num_cpus for s in scales)),
                      ("GPU", sum(s.most_replicas * s.num_gpus for s in scales))):
        have = available.get(key, 0.0)
        if need > have + 1e-9:
            raise ConfigError(f"the deployments need {need:g} {key}s ({', '.join(_needs(scales, key))}); "
                              f"the Ray cluster has {have:g}: fewer replicas or smaller shares")


def _needs(scales: list[StageScale], key: str) -> list[str]:
    return [f"{s.most_replicas} x {s.num_cpus if key == 'CPU' else s.num_gpus:g}" for s in scales]


def _cluster_fits(scales: list[StageScale], check: bool) -> None:
    if check:
        import ray

        check_fits(scales, ray.cluster_resources())


def deploy_speech(app: SpeechApp, name: str = "flashrt-speech", route_prefix: str = "/",
                  blocking: bool = False, check_resources: bool = True) -> Any:
    """Run `app` on the connected Ray cluster (``ray.init`` first; Serve is started when it is not);
    the ingress's handle. Returns once every replica has loaded and captured. ``check_resources``:
    refuse at once (`check_fits`) what the cluster cannot hold at all (off for an autoscaling cluster)."""
    _cluster_fits([app.lm, app.vocoder, app.ingress], check_resources)
    return _serve().run(speech_app(app), name=name, route_prefix=route_prefix, blocking=blocking)


def deploy_policy(app: PolicyApp, name: str = "flashrt-policy", route_prefix: str = "/",
                  blocking: bool = False, check_resources: bool = True) -> Any:
    """Run `app` on the connected Ray cluster; the deployment's handle (``check_resources``: as
    `deploy_speech`)."""
    _cluster_fits([app.scale], check_resources)
    return _serve().run(policy_app(app), name=name, route_prefix=route_prefix, blocking=blocking)


def speech_builder(args: dict[str, Any]) -> Any:
    """The application builder a Serve config's ``import_path`` names
    (``flashrt.integrations.ray_serve:speech_builder``): `SpeechApp.args` -> the application."""
    return speech_app(SpeechApp.from_args(dict(args)))


def parse_count(text: str, flag: str = "--replicas") -> dict[str, int | None]:
    """``N`` or ``MIN-MAX`` (autoscaling between them) -> `StageScale` fields (replicas, max_replicas)."""
    low, sep, high = text.strip().partition("-")
    if not low.isdigit() or int(low) < 1 or sep and (not high.isdigit() or int(high) < int(low)):
        raise ConfigError(f"{flag} {text!r}: give a count N >= 1, or MIN-MAX (autoscaling) with "
                          "1 <= MIN <= MAX")
    return {"replicas": int(low), "max_replicas": int(high) if sep else None}


def parse_replicas(spec: str) -> dict[str, dict[str, int | None]]:
    """``lm=1-3,vocoder=1`` -> {"lm": {"replicas": 1, "max_replicas": 3}, "vocoder": {"replicas": 1,
    "max_replicas": None}}: stages of `STAGES` (each once), each a count or a MIN-MAX range
    (`parse_count`)."""
    counts: dict[str, dict[str, int | None]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, count = part.partition("=")
        if not sep or stage not in STAGES or stage in counts:
            raise ConfigError(f"--replicas {spec!r}: give STAGE=COUNT[,...] with STAGE one of {STAGES} "
                              "(each once) and COUNT a count >= 1 or MIN-MAX")
        counts[stage] = parse_count(count, f"--replicas {stage}=")
    return counts


def init_local(**options: Any) -> None:
    """Start a one-node Ray cluster on this machine's loopback only (127.0.0.1 for every Ray port).
    Ray swaps a loopback node address for the machine's routable one unless it is told the node is not
    part of a cluster, by its own variable RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which is set here for this
    process and the ones Ray starts (only when flashrt starts the cluster itself)."""
    import ray
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the processes Ray starts read it at import
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported ray already: its copy of the flag
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **options)


def policy_builder(args: dict[str, Any]) -> Any:
    """The application builder of a policy's Serve config: `PolicyApp.args` -> the application."""
    return policy_app(PolicyApp.from_args(dict(args)))


# what a Serve config of each kind of app names: (its import_path, the application's default name)
CONFIG_KINDS: dict[type, tuple[str, str, Any]] = {
    SpeechApp: ("flashrt.integrations.ray_serve:speech_builder", "flashrt-speech", speech_deployments),
    PolicyApp: ("flashrt.integrations.ray_serve:policy_builder", "flashrt-policy", policy_deployments),
}


def serve_config(app: SpeechApp | PolicyApp, host: str = "127.0.0.1", port: int = 8000,
                 name: str | None = None, route_prefix: str = "/") -> dict[str, Any]:
    """Serve's own config (``serve deploy config.yaml``) running `app`: its ``args`` (what the builder
    rebuilds the app from: plain values only, so options such as a `Sampling` object are refused here)
    and its ``deployments`` (each one's Serve options: replicas or ``autoscaling_config``, resources,
    request bounds; Serve applies them over the builder's, so an operator may edit them there)."""
    import json

    import_path, default_name, deployments = CONFIG_KINDS[type(app)]
    args = app.args()
    try:
        json.dumps(args)
    except TypeError as exc:
        raise ConfigError(f"a Serve config holds plain values only: {exc}") from None
    return {"http_options": {"host": host, "port": port},
            "applications": [{"name": name or default_name, "route_prefix": route_prefix,
                              "import_path": import_path, "args": args,
                              "deployments": [{"name": deployment, **options}
                                              for deployment, options in deployments(app).items()]}]}


def _write_config(app: SpeechApp | PolicyApp, path: Path, host: str, port: int, command: str) -> None:
    import typer
    import yaml  # a dependency of ray

    path.write_text(yaml.safe_dump(serve_config(app, host, port), sort_keys=False))
    typer.echo(f"{command}: wrote {path} (serve deploy {path})")


def _serve_until_interrupted(deploy: Any, *, host: str, port: int, address: str | None, line: str) -> None:
    """Join the cluster at ``address`` (None: start a local one, `init_local`), start Serve's HTTP proxy
    on ``host:port``, run ``deploy()``, print ``line`` and serve until interrupted; Serve and the Ray
    connection are shut down on every way out."""
    import time

    import ray
    import typer

    if address is None:
        init_local()  # Serve's HTTP proxy binds ``host`` alone
    else:
        ray.init(address=address)
    serve = _serve()
    try:
        serve.start(http_options={"host": host, "port": port})
        deploy()
        typer.echo(line)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def policy_command(folder: str, options: dict[str, Any], *, host: str, port: int, address: str | None,
                   replicas: str, write_config: Path | None) -> None:
    """`flashrt serve-policy --ray`: the policy at `folder` as a `PolicyApp` (``replicas``: a count);
    with ``write_config`` its Serve config written there (nothing started), else deployed as
    `serve_command` does, the openpi websocket at ``ws://host:port/``."""
    app = PolicyApp(str(Path(folder).resolve()), options, StageScale(**parse_count(replicas or "1")))
    if write_config is not None:
        _write_config(app, write_config, host, port, "flashrt serve-policy")
        return
    _serve_until_interrupted(lambda: deploy_policy(app), host=host, port=port, address=address,
                             line=f"flashrt serve-policy: {Path(folder).name} on Ray Serve at "
                                  f"ws://{host}:{port} (POST /infer; Ctrl-C stops)")


def serve_command(voices: dict[str, str], options: dict[str, Any], limits: Any, *, host: str, port: int,
                  address: str | None, replicas: str, write_config: Path | None) -> None:
    """`flashrt serve --ray`: one Orpheus-style voice as a `SpeechApp`; with ``write_config`` its Serve
    config written there (nothing started), else deployed on the cluster at ``address`` (None: a local
    one; Ray puts its own node on the machine's routable address, never a loopback one) and served on
    ``host:port`` until interrupted."""
    if len(voices) != 1:
        raise ConfigError(f"--ray serves one voice (an Orpheus-style folder), got {sorted(voices) or 'none'}")
    (name, folder), = voices.items()
    counts = parse_replicas(replicas)
    scales = {stage: replace(getattr(SpeechApp, stage), **counts[stage]) for stage in counts}
    app = SpeechApp(str(Path(folder).resolve()), name, options, limits=limits, **scales)
    if write_config is not None:
        _write_config(app, write_config, host, port, "flashrt serve")
        return
    _serve_until_interrupted(lambda: deploy_speech(app), host=host, port=port, address=address,
                             line=f"flashrt serve: voice {name!r} on Ray Serve at http://{host}:{port} "
                                  "(Ctrl-C stops)")
