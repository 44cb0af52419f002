"""Orpheus-style TTS: a causal LM emitting SNAC codes, streamed through the SNAC decoder, as one chain.

    tts = flashrt.load_tts("orpheus_dir")          # LM folder with snac/ inside, or snac="snac_dir"
    for chunk in tts.stream("Hi!", voice="tara"):  # float32 chunks; format="pcm16" for int16
        ...
    tts.report()                                   # ttfa_ms, rtf, tokens/s, per-stage LatencyStats

Registered as the "orpheus" family of `flashrt.frontends.registry.TTS_FAMILIES` (`flashrt.load_tts`,
`flashrt say "text" --model DIR --speaker tara`); it answers the `TtsFamily` model interface there
(``sample_rate``, ``__call__``, ``stream``, ``seed``/``speed`` options, ``describe``) plus ``voice``
(the speaker name of Orpheus' prompt), ``sampling`` and ``report()``.

The chain (`flashrt.chain.Chain`, one worker thread per stage, bounded queues between them):

    lm      prompt ids -> audio token ids       `flashrt.runtime.decode.Decoder` (captured prefill
                                                buckets, one decode step replayed per token)
    frames  token ids -> SNAC code chunks       `flashrt.frontends.tts.orpheus.FrameDecoder` (7 tokens
                                                a frame, validated; `frames_per_chunk` frames a chunk)
    snac    code chunks -> audio chunks         the vocoder's `stream()` (exact overlap windows, so the
                                                chunks concatenate to the one-shot decode)

`tts(text)` runs the same chain in one-shot mode (all frames, one `vocoder(codes)` call), so the two
never use a frontend at the same time. Every stage runs one request at a time, requests in order; a
bad token ends the request with a StageError naming "frames" (its cause an `AudioTokenError`).

Facts about Orpheus (token layout, prompt, frame interleave, defaults) and where they come from:
`flashrt.frontends.tts.orpheus`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import flashrt
from flashrt.chain import Chain, Stage
from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.lm import load_lm
from flashrt.frontends.lm.frontend import read_config
from flashrt.frontends.registry import TtsFamily
from flashrt.frontends.tts.orpheus import (
    FRAME,
    FrameDecoder,
    OrpheusLayout,
    format_prompt,
    load_text_tokenizer,
    read_layout,
    stack_frames,
)
from flashrt.io.inputs import check_seed
from flashrt.runtime.decode import Decoder, Generation, Sampling

__all__ = ["OrpheusTTS", "load_orpheus", "detect", "FAMILY", "ORPHEUS_SAMPLING", "to_pcm16",
           "frame_constraint"]

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


class OrpheusTTS:
    """A loaded Orpheus-style TTS (module docstring). Built by `load_orpheus`."""

    family = "orpheus"

    def __init__(self, decoder: Decoder, vocoder: Any, layout: OrpheusLayout, tokenizer: Any, *,
                 sample_rate: int, frames_per_chunk: int = 1, queue_size: int = 8,
                 sampling: Sampling = ORPHEUS_SAMPLING) -> None:
        self.decoder, self.vocoder, self.layout, self.tokenizer = decoder, vocoder, layout, tokenizer
        self.sample_rate = int(sample_rate)
        self.frames_per_chunk, self.sampling = int(frames_per_chunk), sampling
        self.chain = Chain([Stage("lm", self._lm), Stage("frames", self._frames), Stage("snac", self._snac)],
                           queue_size=queue_size)
        self._last: dict[str, Any] = {}

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
    def _lm(self, items: Iterator[_Job], request: Any) -> Iterator[int]:
        job = next(items)
        stop = self.layout.stop_tokens  # tokens read a frame (7) at a time: one host sync per frame
        yield from self.decoder.generate(job.prompt, job.max_new_tokens, stop, job.sampling, sync_every=FRAME)
        job.generation = self.decoder.last

    def _frames(self, tokens: Iterator[int], request: Any) -> Iterator[tuple[torch.Tensor, ...]]:
        job, decoder, held = request.payload, FrameDecoder(self.layout), []
        per_chunk = None if job.oneshot else self.frames_per_chunk
        for token in tokens:
            frame = decoder.push(token)
            if frame is not None:
                held.append(frame)
                job.frames += 1
            if per_chunk is not None and len(held) == per_chunk:
                yield stack_frames(held)
                held = []
        job.dropped_tokens = decoder.pending
        if held:
            yield stack_frames(held)

    def _snac(self, chunks: Iterator[tuple[torch.Tensor, ...]], request: Any) -> Iterator[np.ndarray]:
        if request.payload.oneshot:
            for codes in chunks:
                yield _mono(self.vocoder(*codes))
            return
        for audio in self.vocoder.stream(chunks):
            yield _mono(audio)

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
                "frames_per_chunk": self.frames_per_chunk, "layout": self.layout.__dict__,
                "vocoder": _describe(self.vocoder)}

    def close(self) -> None:
        self.chain.close()


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


# ---------------------------------------------------------------------------------------- loading

def _snac_folder(folder: Path, given: str | Path | None) -> Path:
    snac = Path(given) if given else folder / "snac"
    if not (snac / "config.json").is_file():
        raise CheckpointError(f"no SNAC decoder at {snac} (put it in <model>/snac/ or pass snac=<folder>)")
    return snac


def _snac_codebook(snac: Path) -> tuple[int, int]:
    """(codebook size, sampling rate) of a SNAC config.json."""
    from flashrt.io.files import read_json

    cfg = read_json(snac / "config.json", "SNAC config")
    try:
        return int(cfg.get("codebook_size", 4096)), int(cfg.get("sampling_rate", 24000))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{snac}/config.json: not a readable SNAC config ({exc})") from None


def detect(source: str | Path) -> None:
    """None for an Orpheus-style folder: a transformers causal LM whose vocabulary holds Orpheus' audio
    codes (the codebook of its snac/ decoder if there is one, else SNAC 24 kHz's 4096)."""
    folder = Path(source)
    if not folder.is_dir():
        raise CheckpointError(f"{source}: not a folder")
    snac = folder / "snac"
    _layout(folder, _snac_codebook(snac)[0] if (snac / "config.json").is_file() else 4096)


def _layout(folder: Path, codebook: int) -> OrpheusLayout:
    """The folder's token layout, checked against its LM's vocabulary."""
    vocab, layout = read_config(folder).vocab_size, read_layout(folder, codebook)
    if vocab < layout.vocab_needed:
        raise CheckpointError(f"{folder}: vocabulary {vocab} has no room for Orpheus' audio codes (needs "
                              f"{layout.vocab_needed}: ids from {layout.audio_base}, 7 x {codebook})")
    return layout


def load_orpheus(folder: str | Path, *, snac: str | Path | None = None, device: str = "cpu",
                 precision: str = "fp32", backend: str | None = None, max_new_tokens: int = 1200,
                 cache_len: int = 2048, prompt_buckets: tuple[int, ...] = (32, 64, 128, 256),
                 stream_chunk: int | None = None, frames_per_chunk: int = 1, queue_size: int = 8,
                 sampling: Sampling = ORPHEUS_SAMPLING, constrain_frames: bool = False,
                 snac_noise: str | None = None) -> OrpheusTTS:
    """Load the LM (strict), the SNAC decoder (`flashrt.load_vocoder`), capture, and build the chain.

    ``precision`` is the LM's; SNAC decodes in float32, as the reference does. ``stream_chunk``: SNAC
    frames decoded per stream window (each window adds the decoder's context, 3 frames a side at
    24 kHz): fewer means earlier first audio and more decoding; None takes 1 on a GPU (first audio
    after 4 frames, 28 tokens, as Orpheus' own streamer) and 4 on a CPU (the windows cost ~2.5x less
    there). ``constrain_frames``: see `frame_constraint` (off: the reference samples freely).
    ``snac_noise``: the SNAC decoder's ``noise_mode`` (None: "off", which drops the released decoder's
    noise; "seeded" adds it reproducibly; `flashrt.runner.vocoder`)."""
    folder = Path(folder)
    snac_dir = _snac_folder(folder, snac)
    codebook, rate = _snac_codebook(snac_dir)
    layout = _layout(folder, codebook)
    lm = load_lm(folder, device=device, precision=precision, cache_len=cache_len)
    constraint = frame_constraint(layout) if constrain_frames else None
    decoder = Decoder(lm, prompt_buckets, max_new_tokens=max_new_tokens, backend=backend,
                      constraint=constraint).capture()
    if stream_chunk is None:
        stream_chunk = 1 if torch.device(device).type == "cuda" else 4
    noise = {"noise_mode": snac_noise} if snac_noise is not None else None
    vocoder = flashrt.load_vocoder(snac_dir, device=device, backend=backend, stream_chunk=stream_chunk,
                                   overrides=noise)
    return OrpheusTTS(decoder, vocoder, layout, load_text_tokenizer(folder, layout), sample_rate=rate,
                      frames_per_chunk=frames_per_chunk, queue_size=queue_size,
                      sampling=sampling)


FAMILY = TtsFamily(
    name="orpheus", detect=detect, load=load_orpheus,
    options=("snac", "max_new_tokens", "cache_len", "prompt_buckets", "stream_chunk", "frames_per_chunk",
             "queue_size", "sampling", "constrain_frames", "snac_noise"),
    doc="Orpheus-style LM (Llama/Qwen) emitting SNAC 24 kHz codes, streamed through the SNAC decoder")
