"""Orpheus-style TTS: a causal LM emitting SNAC codes, streamed through the SNAC decoder, as one chain.
(`OrpheusTTS` here; `flashrt.runner.orpheus.load_orpheus` loads the LM and the SNAC decoder and builds it.)

    tts = flashrt.load_tts("orpheus_dir")          # LM folder with snac/ inside, or snac="snac_dir"
    for chunk in tts.stream("Hi!", voice="tara"):  # float32 chunks; format="pcm16" for int16
        ...
    tts.report()                                   # ttfa_ms, rtf, tokens/s, per-stage LatencyStats

Registered as the "orpheus" family of `flashrt.frontends.registry.TTS_FAMILIES` (`flashrt.load_tts`,
`flashrt say "text" --model DIR --speaker tara`); it answers the `TtsFamily` model interface there
(``sample_rate``, ``__call__``, ``stream``, ``seed``/``speed`` options, ``describe``) plus ``voice``
(the speaker name of Orpheus' prompt), ``sampling`` and ``report()``.

The chain (`flashrt.chain.Chain`, bounded queues between the stages):

    lm      prompt ids -> SNAC code chunks      a continuous stage (`Stage.continuous`): every request
                                                is a row of one `flashrt.runtime.slots.SlotDecoder`
                                                (``slots`` rows, one decode step captured per batch
                                                bucket), joining when a row is free and leaving when it
                                                stops; each step's tokens (a frame, 7 tokens) become
                                                SNAC frames (`FrameDecoder`: validated), sent on in
                                                chunks that each make one SNAC window due
                                                (`chunk_plan`; ``frames_per_chunk`` to fix it)
    snac    code chunks -> audio chunks         a batched stage: each request's own SNAC stream
                                                (`StreamRunner.open`: exact overlap windows, so the
                                                chunks concatenate to the one-shot decode); the windows
                                                due across requests decoded together, those of one
                                                length stacked as rows of one replay
                                                (`StreamRunner.decode_together`; one row each with
                                                seeded SNAC noise, whose positions are per window)

So several requests decode at once, each at its own pace, and each stage's batch follows its compute
(live rows of the LM), not the arrival of requests. A request's tokens are those it would get alone
(greedy: the same argmax; sampled: the same draws per seed, whatever shares its batch). `tts(text)`
runs the same chain in one-shot mode (all frames, one `vocoder(codes)` call). A bad token ends only
its request, with a StageError naming "lm" (its cause an `AudioTokenError`); a client that stops
reading pauses only its own row.

Facts about Orpheus (token layout, prompt, frame interleave, defaults) and where they come from:
`flashrt.frontends.orpheus.layout`; reading a model folder: `flashrt.frontends.orpheus.folder`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from flashrt.chain import Chain, Stage
from flashrt.chain.continuous import Emit
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.orpheus.layout import (
    FRAME,
    VOICES,
    FrameDecoder,
    OrpheusLayout,
    format_prompt,
    stack_frames,
)
from flashrt.io.inputs import check_seed
from flashrt.runtime.decode import Generation, Sampling
from flashrt.runtime.frontend import ChunkSchedule
from flashrt.runtime.slots import Seat, SlotDecoder
from flashrt.runtime.threads import CpuLoad, check_threads, choose_threads, torch_threads

__all__ = ["OrpheusTTS", "ORPHEUS_SAMPLING", "to_pcm16", "frame_constraint", "chunk_plan", "ChunkPlan",
           "lm_backend", "stage_threads"]

ORPHEUS_SAMPLING = Sampling(temperature=0.6, top_p=0.8, repetition_penalty=1.3)  # the engine's defaults
FORMATS = ("float32", "pcm16")


@dataclass
class _Job:
    """One request through the chain: what to say and how; what happened (filled by the stages)."""

    prompt: list[int]
    sampling: Sampling
    max_new_tokens: int
    oneshot: bool
    generation: Generation = field(default_factory=Generation)
    frames: int = 0
    dropped_tokens: int = 0
    snac: Any = None  # this request's SNAC stream (`StreamRunner.open`), made at its first chunk


@dataclass
class _Codes:
    """What the lm stage sends the snac stage: stacked frames (None: none) and whether they are the last;
    ``queued`` once the snac stage has queued them (a retry alone after a failed batch does not again)."""

    codes: tuple[torch.Tensor, ...] | None
    last: bool
    queued: bool = False


@dataclass
class _Row:
    seat: Seat
    frames: FrameDecoder
    due: int  # the frame count at which the held frames are sent on (`chunk_plan`)
    held: list = field(default_factory=list)


class _LMEngine:
    """The lm stage's engine (`flashrt.chain.continuous.Engine`): requests are rows of the SlotDecoder;
    each step's tokens become SNAC frames."""

    def __init__(self, tts: OrpheusTTS) -> None:
        self.tts, self.decoder = tts, tts.decoder
        self.capacity = tts.decoder.rows
        self.rows: dict[Any, _Row] = {}

    def join(self, request: Any, job: _Job) -> None:
        stops = self.tts.layout.stop_tokens
        with torch_threads(self.tts.threads):
            seat = self.decoder.join(job.prompt, job.max_new_tokens, stops, job.sampling)
        job.generation = seat.generation
        self.rows[request] = _Row(seat, FrameDecoder(self.tts.layout), self.tts.chunk_plan.first)

    def leave(self, request: Any) -> None:
        row = self.rows.pop(request, None)
        if row is not None:
            self.decoder.leave(row.seat)

    def pause(self, request: Any, paused: bool) -> None:
        row = self.rows.get(request)
        if row is not None:
            self.decoder.pause(row.seat, paused)

    def step(self) -> list[Emit]:
        with torch_threads(self.tts.threads):
            seats = set(self.decoder.step(blocks=FRAME))
        return [self._frames(request, row) for request, row in list(self.rows.items()) if row.seat in seats]

    def _frames(self, request: Any, row: _Row) -> Emit:
        job, seat = request.payload, row.seat
        try:
            for token in seat.new:
                frame = row.frames.push(token)
                if frame is not None:
                    row.held.append(frame)
                    job.frames += 1
        except Exception as exc:  # noqa: BLE001 - a bad token ends only this request
            self.leave(request)
            return Emit(request, error=exc)
        if seat.done:
            self.rows.pop(request, None)
            job.dropped_tokens = row.frames.pending
        if not seat.done and (job.oneshot or job.frames < row.due):
            return Emit(request)
        while row.due <= job.frames:
            row.due = self.tts.chunk_plan.next_due(row.due)
        codes = stack_frames(row.held) if row.held else None
        row.held = []
        return Emit(request, _Codes(codes, seat.done), done=seat.done)


class OrpheusTTS:
    """A loaded Orpheus-style TTS (module docstring). Built by `load_orpheus`."""

    family = "orpheus"
    speakers = VOICES  # the English fine-tune's voices (any name is put in the prompt as given)

    def __init__(self, decoder: SlotDecoder, vocoder: Any, layout: OrpheusLayout, tokenizer: Any, *,
                 sample_rate: int, frames_per_chunk: int | None = None, queue_size: int = 8,
                 sampling: Sampling = ORPHEUS_SAMPLING, stack_windows: bool = True,
                 threads: int | None = None) -> None:
        self.decoder, self.vocoder, self.layout, self.tokenizer = decoder, vocoder, layout, tokenizer
        self.sample_rate = int(sample_rate)
        self.frames_per_chunk, self.sampling = frames_per_chunk, sampling
        self.chunk_plan = chunk_plan(frames_per_chunk, vocoder)
        self.threads = threads  # torch threads per op of each stage (None: torch's setting); `stage_threads`
        self.stack_windows = stack_windows
        self.chain = self._build_chain(queue_size=queue_size)
        self._last: dict[str, Any] = {}

    def _build_chain(self, **limits: Any) -> Chain:
        stages = [Stage.continuous("lm", _LMEngine(self))]
        if self.vocoder is not None:  # None: the LM stage alone (`load_orpheus(..., vocoder=False)`)
            rows = self.vocoder.frontend.batch if self.stack_windows else 1
            stages.append(Stage.batched("snac", self._snac, rows))
        return Chain(stages, **limits)

    def serving_chain(self, queue_size: int = 8, max_pending: int = 64,
                      send_timeout_s: float | None = None) -> Chain:
        """This model's chain rebuilt with a server's limits (the speech server submits `request` jobs
        to it, so its requests decode together); `stream` and calls use it too from then on."""
        self.chain.close()
        self.chain = self._build_chain(queue_size=queue_size, max_pending=max_pending,
                                       send_timeout_s=send_timeout_s)
        return self.chain

    # ------------------------------------------------------------------------------ requests
    def prompt_ids(self, text: str, voice: str | None = None) -> list[int]:
        return format_prompt(self.layout, self.tokenizer, text, voice)

    def request(self, text: str, voice: str | None = None, seed: int | None = None,
                sampling: Sampling | None = None, max_new_tokens: int | None = None,
                oneshot: bool = False, speed: float = 1.0) -> _Job:
        """A checked job (InputError here, before the chain sees it)."""
        if speed != 1.0:
            raise InputError(f"speed {speed}: Orpheus has no rate control (its README: a higher temperature "
                             "and repetition penalty speak faster); use speed=1")
        sampling = sampling or self.sampling
        if seed is not None:
            sampling = replace(sampling, seed=check_seed(seed))
        prompt = self.prompt_ids(text, voice)
        room = self.decoder.model.cache_len - len(prompt)  # the default fills the cache at most
        limit = max_new_tokens or min(self.decoder.max_new_tokens, room)
        job = _Job(prompt, sampling.check(), limit, oneshot)
        self.decoder.check(job.prompt, job.max_new_tokens, job.sampling)
        return job

    def stream(self, text: str, voice: str | None = None, seed: int | None = None,
               sampling: Sampling | None = None, max_new_tokens: int | None = None,
               format: str = "float32", speed: float = 1.0) -> Iterator[np.ndarray]:
        """Audio chunks (1-D, float32 or int16) as soon as each is decoded. The request is checked
        before this returns (InputError); the chain starts on the first ``next``."""
        if format not in FORMATS:
            raise InputError(f"format {format!r}; choose one of {FORMATS}")
        start = time.perf_counter()
        job = self.request(text, voice, seed, sampling, max_new_tokens, speed=speed)
        return self._iterate(job, start, format)

    async def astream(self, text: str, voice: str | None = None, seed: int | None = None,
                      sampling: Sampling | None = None, max_new_tokens: int | None = None,
                      format: str = "float32") -> AsyncIterator[np.ndarray]:
        """`stream` for ``async for``: the chain's workers compute, the event loop only awaits chunks;
        cancelling the task cancels the request."""
        if format not in FORMATS:
            raise InputError(f"format {format!r}; choose one of {FORMATS}")
        start = time.perf_counter()
        job = self.request(text, voice, seed, sampling, max_new_tokens)
        samples, first = 0, None
        async for chunk in self.chain.submit(job):
            first = first if first is not None else (time.perf_counter() - start) * 1e3
            samples += chunk.shape[-1]
            yield to_pcm16(chunk) if format == "pcm16" else chunk
        self._record(job, start, first, samples)

    def _iterate(self, job: _Job, start: float, format: str) -> Iterator[np.ndarray]:
        request, samples, first = self.chain.submit(job), 0, None
        for chunk in request:
            if first is None:
                first = (time.perf_counter() - start) * 1e3
            samples += chunk.shape[-1]
            yield to_pcm16(chunk) if format == "pcm16" else chunk
        self._record(job, start, first, samples)

    def __call__(self, text: str, voice: str | None = None, seed: int | None = None,
                 sampling: Sampling | None = None, max_new_tokens: int | None = None,
                 speed: float = 1.0) -> np.ndarray:
        """The whole utterance as one float32 array (one vocoder call over every frame)."""
        start = time.perf_counter()
        job = self.request(text, voice, seed, sampling, max_new_tokens, oneshot=True, speed=speed)
        chunks = list(self._iterate(job, start, "float32"))
        return chunks[0] if chunks else np.zeros(0, dtype=np.float32)

    # ------------------------------------------------------------------------------ stages
    def _snac(self, items: list[_Codes], requests: list[Any]) -> list[np.ndarray | None]:
        """The snac stage (batched): each request's codes into its own SNAC stream, then the windows due
        in all of them decoded together, windows of one length stacked as rows of one replay."""
        with torch_threads(self.threads):
            return self._snac_windows(items, requests)

    def _snac_windows(self, items: list[_Codes], requests: list[Any]) -> list[np.ndarray | None]:
        outs: list[np.ndarray | None] = [None] * len(items)
        streams = []
        for k, (item, request) in enumerate(zip(items, requests)):
            job = request.payload
            if job.oneshot:
                outs[k] = _mono(self.vocoder(*item.codes)) if item.codes is not None else None
                continue
            job.snac = job.snac or self.vocoder.open()
            if not item.queued:
                if item.codes is not None:
                    job.snac.feed(item.codes)
                if item.last:
                    job.snac.finish()
                item.queued = True
            streams.append((k, job.snac))
        self.vocoder.decode_together([st for _, st in streams], stack=self.stack_windows)
        for k, stream in streams:
            audio = stream.take()
            outs[k] = np.concatenate([_mono(a) for a in audio]) if audio else None
        return outs

    # ------------------------------------------------------------------------------ reporting
    def _record(self, job: _Job, start: float, first_ms: float | None, samples: int) -> None:
        total = (time.perf_counter() - start) * 1e3
        audio_s = samples / self.sample_rate
        gen = job.generation
        self._last = {"ttfa_ms": first_ms, "total_ms": total, "audio_s": audio_s,
                      "rtf": total / 1e3 / audio_s if audio_s else None, "frames": job.frames,
                      "tokens": len(gen.tokens), "finish": gen.finish, "dropped_tokens": job.dropped_tokens,
                      "prefill_ms": gen.prefill_ms, "first_token_ms": gen.first_token_ms,
                      "tokens_per_s": len(gen.tokens) / (gen.total_ms / 1e3) if gen.total_ms else None,
                      "mode": "oneshot" if job.oneshot else "stream"}

    def report(self) -> dict[str, Any]:
        """The last utterance (ttfa_ms from the call to the first audio chunk, rtf = wall time / audio
        duration, tokens/s of the LM) and the chain's per-stage statistics."""
        return {**self._last, "stages": self.chain.stats()["stages"], "decoder": self.decoder.report()}

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "sample_rate": self.sample_rate, "decoder": self.decoder.describe(),
                "frames_per_chunk": self.frames_per_chunk, "threads": self.threads,
                "layout": self.layout.__dict__,
                "vocoder": _describe(self.vocoder)}

    def close(self) -> None:
        self.chain.close()


@dataclass(frozen=True)
class ChunkPlan:
    """When the lm stage sends a request's held frames on: at ``first`` frames, then at each
    `next_due` (the frame count the next chunk is due at)."""

    schedule: ChunkSchedule
    right: int = 0  # frames a window waits for past the ones it keeps (the vocoder's right context)

    @property
    def first(self) -> int:
        return self.schedule.chunk(0) + self.right

    def next_due(self, due: int) -> int:
        emitted = due - self.right  # what the vocoder's stream has decoded once this chunk's window ran
        return emitted + self.schedule.chunk(emitted) + self.right


def chunk_plan(frames_per_chunk: int | None, vocoder: Any) -> ChunkPlan:
    """When the lm stage sends frames to the snac stage.

    None follows the vocoder's stream windows (`flashrt.runner.stream.ChunkSchedule`): its first window
    needs the first chunk plus the right context, each later one its own chunk more, so each code chunk
    makes exactly one window due and no frame waits in a queue for a window that could already be
    decoded (sending frames one at a time made the snac stage take a new request's first window one
    frame per call, behind every other request's items). Without a vocoder (the split chain), one frame
    a chunk. An int: that many frames a chunk."""
    if frames_per_chunk is not None:
        if isinstance(frames_per_chunk, bool) or not isinstance(frames_per_chunk, int) \
                or frames_per_chunk < 1:
            raise ConfigError(f"frames_per_chunk must be a positive int or None, got {frames_per_chunk!r}")
        return ChunkPlan(ChunkSchedule(frames_per_chunk, frames_per_chunk))
    if vocoder is None:
        return ChunkPlan(ChunkSchedule(1, 1))
    return ChunkPlan(vocoder.schedule, int(vocoder.frontend.context[1]))


def lm_backend(lm_graphs: str | None, backend: str | None, device: torch.device) -> str | None:
    """The graph backend of the LM's slot decoder: ``lm_graphs`` if given, else ``backend``; with
    neither, "jit" on the CPU (the decode step traced into TorchScript, `flashrt.runtime.jit`: the
    same tokens bit for bit at half eager's host time, and the GIL free while it runs, so the SNAC
    stage and the server run beside it) and the device's default elsewhere."""
    if lm_graphs is not None:
        return lm_graphs
    if backend is None and torch.device(device).type == "cpu":
        return "jit"
    return backend


def stage_threads(threads: int | str | None, device: str | torch.device, stages: int) -> int | None:
    """torch threads per op of each stage: on the CPU, ``"auto"`` shares the cores free at load between
    the ``stages`` computing at once (the LM and SNAC stages run on their own threads: with torch's
    default, two pools of every core on a 2-core machine oversubscribed it; `flashrt.runtime.threads`),
    an int is used as given, None leaves torch's setting; elsewhere None."""
    threads = check_threads(threads)
    if torch.device(device).type != "cpu" or threads is None:
        return None
    load = CpuLoad.probe() if threads == "auto" else None
    return choose_threads(threads, load, ceiling=torch.get_num_threads(), stages=stages)


def frame_constraint(layout: OrpheusLayout):
    """A `Decoder` constraint: the k-th generated token may only be a code of place k % 7 (no stop
    token, so an utterance runs to ``max_new_tokens``). Off by default (the reference samples freely);
    it makes random-weight models speak in valid frames, for benchmarks."""
    def constrain(logits: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        lo = layout.audio_base + (step % 7) * layout.codebook_size
        allowed = (ids >= lo) & (ids < lo + layout.codebook_size)
        return torch.where(allowed, logits, torch.full((), -torch.inf, device=logits.device))
    return constrain


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """float32 audio in [-1, 1] -> int16 PCM samples (clipped, rounded to nearest)."""
    return np.round(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def _mono(audio: Any) -> np.ndarray:
    array = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    return np.ascontiguousarray(array.reshape(-1) if array.ndim == 1 else array[0], dtype=np.float32)


def _describe(vocoder: Any) -> Any:
    describe = getattr(vocoder, "describe", None)
    return describe() if callable(describe) else type(vocoder).__name__
