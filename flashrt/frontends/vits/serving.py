"""Many Piper requests at once: one voice interleaves its requests chunk by chunk.

    chain = voice.serving_chain(max_pending=64)        # what `flashrt serve` does with a Piper voice
    for chunk in chain.submit(voice.request("Hello.", seed=1)):
        play(chunk)                                     # the chunks `voice.stream("Hello.", seed=1)` gives

A voice owns one set of buffers and captured graphs, so requests cannot run side by side; served one
after another, the tenth request of a burst waits for nine whole utterances before its first audio.
`SpeechEngine` (a `flashrt.chain.continuous.Engine`) holds up to ``capacity`` requests and computes one
chunk at a time for the request whose listener runs out of audio first (earliest deadline first):

- a request without audio yet is due when it joined (so a new request gets its first chunk next, a
  sentence's prior and the flow's prefix and one decoder window, not after the others' utterances);
- a streaming request is due when the audio it has been sent ends, counted from its first chunk.

Requests join while the voice can keep them all ahead of playback: the engine measures compute time
per second of audio over its chunks and lets in at most ``HEADROOM / rtf`` requests (never more than
``capacity``, at least one); the rest wait in the chain's queue (where admission with a deadline
refuses what would wait too long), instead of every live stream falling behind.

What a request needs between its chunks is its own, not the voice's: after its first window, the
inputs the rest of the flow reads (the prior's mean and log-std, the frame index, the prior noise, the
scales) are kept (`FlowInputs`) and put back for the flow, the flow's output z for the sentence is kept
for its windows, and a multi-speaker voice's speaker (the flow's g, the decoder's conditioning) is set
again before each of the request's steps. Every chunk is computed by the same captured graphs on the
same values as in `VitsVoice.stream`, so a request's chunks are identical to the request served alone,
whatever shares the voice. The engine holds the voice's lock for one chunk at a time: a caller
streaming directly from the voice waits only for the chunk being computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flashrt.chain.continuous import Emit
from flashrt.errors import ConfigError
from flashrt.runtime.threads import torch_threads

if TYPE_CHECKING:
    from flashrt.frontends.vits.frontend import FlowInputs, Plan, Window
    from flashrt.frontends.vits.voice import VitsVoice

__all__ = ["SpeechJob", "SpeechEngine", "CAPACITY"]

CAPACITY = 8  # requests interleaved at once; more wait for a place (each one's share of the voice shrinks)
HEADROOM = 0.8  # the share of real time the live requests' chunks may take together
SMOOTHING = 0.1  # weight of the newest chunk in the compute-per-audio average


@dataclass
class SpeechJob:
    """A checked request: the phoneme ids of each sentence, each sentence's seed, the resolved scales."""

    sentences: list[list[int]]
    seeds: list[int | None]
    scales: dict[str, Any]
    first_chunk: int  # frames of each sentence's first window, then of the others
    chunk: int


@dataclass
class _Sentence:
    """Where a request is inside its current sentence."""

    plan: Plan
    windows: list[Window]
    next: int = 1  # the first window is decoded when the sentence starts
    saved: FlowInputs | None = None  # the rest of the flow's inputs, until it runs
    z: torch.Tensor | None = None  # the flow's output for the whole sentence, once it ran


@dataclass
class _Speech:
    """One request in the engine."""

    job: SpeechJob
    joined: float
    index: int = 0  # the sentence
    sentence: _Sentence | None = None
    first: float | None = None  # when its first chunk was computed
    audio_s: float = 0.0  # seconds of audio computed so far
    paused: bool = False

    def due(self) -> float:
        """When its listener runs out of audio (joined, before its first chunk)."""
        return self.joined if self.first is None else self.first + self.audio_s


class SpeechEngine:
    """Interleaves the requests of one `VitsVoice` (module docstring)."""

    def __init__(self, voice: VitsVoice, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity {capacity!r}: a count of requests, at least 1")
        self.voice, self.slots, self.clock = voice, capacity, clock
        self.live: dict[Any, _Speech] = {}
        self.rtf: float | None = None  # compute seconds per audio second, a moving average over chunks

    @property
    def capacity(self) -> int:
        """Requests let in at once: ``slots``, fewer when the voice computes too slowly for that many
        listeners to stay ahead of playback (all of them at HEADROOM of real time at the measured rate);
        the chain's worker reads it before each join, so a request waits for a place instead of making
        every live stream fall behind."""
        if not self.rtf:
            return self.slots
        return max(1, min(self.slots, int(HEADROOM / self.rtf)))

    def join(self, request: Any, job: SpeechJob) -> None:
        self.live[request] = _Speech(job, self.clock())

    def leave(self, request: Any) -> None:
        self.live.pop(request, None)

    def pause(self, request: Any, paused: bool) -> None:
        speech = self.live.get(request)
        if speech is not None:
            speech.paused = paused

    def step(self) -> list[Emit]:
        """One chunk for the running request due first."""
        ready = [(s.due(), n, r) for n, (r, s) in enumerate(self.live.items()) if not s.paused]
        if not ready:
            return []
        request = min(ready)[2]
        speech = self.live[request]
        start = self.clock()
        try:
            audio = self._chunk(speech)
        except Exception as exc:  # noqa: BLE001 - a failure ends only this request
            self.live.pop(request, None)
            return [Emit(request, error=exc)]
        now = self.clock()
        speech.first = speech.first if speech.first is not None else now
        seconds = audio.size / self.voice.sample_rate
        speech.audio_s += seconds
        self._measure(now - start, seconds)
        done = speech.index == len(speech.job.sentences)
        if done:
            self.live.pop(request, None)
        return [Emit(request, audio, done=done)]

    def _measure(self, compute_s: float, audio_s: float) -> None:
        if audio_s > 0:
            rtf = compute_s / audio_s
            self.rtf = rtf if self.rtf is None else (1 - SMOOTHING) * self.rtf + SMOOTHING * rtf

    # ------------------------------------------------------------------------------ one chunk
    def _chunk(self, speech: _Speech) -> np.ndarray:
        voice = self.voice
        with voice._lock, torch.inference_mode(), torch_threads(voice.threads):
            if speech.sentence is None:
                audio = self._start(speech)
            else:
                audio = self._next_window(speech)
        if speech.sentence.next == len(speech.sentence.windows):
            speech.sentence, speech.index = None, speech.index + 1
        return audio

    def _start(self, speech: _Speech) -> np.ndarray:
        """A sentence's prior and the flow over its first window's frames, then that window (as
        `VitsVoice.stream_ids` starts); what the rest needs is kept."""
        voice, fe, job = self.voice, self.voice.frontend, speech.job
        plan = voice._plan(job.sentences[speech.index], job.scales, job.seeds[speech.index])
        windows = list(plan.windows(job.first_chunk, job.chunk, fe.context))
        done = fe.flow(plan, upto=windows[0].stop)
        audio = fe.decode(windows[0]).numpy()
        sentence = _Sentence(plan, windows)
        if len(windows) > 1:
            if done < plan.frames:
                sentence.saved = fe.flow_inputs(plan)
            else:
                sentence.z = fe.latent(plan)
        speech.sentence = sentence
        return audio

    def _next_window(self, speech: _Speech) -> np.ndarray:
        fe, sentence = self.voice.frontend, speech.sentence
        fe.use_speaker(speech.job.scales["speaker"])  # the flow and the decoder condition on it
        if sentence.z is None:
            fe.restore_flow_inputs(sentence.saved)
            fe.flow(sentence.plan)
            sentence.z, sentence.saved = fe.latent(sentence.plan), None
        audio = fe.decode(sentence.windows[sentence.next], z=sentence.z).numpy()
        sentence.next += 1
        return audio

