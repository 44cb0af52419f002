"""The stream runner: one-shot and streaming decode over any `StreamFrontend` (vocoders, codec decoders).

It knows no model: only the frontend's input rates (steps per frame), its context (left, right frames
an output frame depends on), its hop (samples per frame) and the verbs check -> bucket -> write ->
replay -> read (`flashrt.runtime.frontend`). A TTS path feeds it codes as a language model emits them.

One-shot ``runner(*inputs, timer=None) -> (B, N)`` float32 on the host, each phase a stage of ``timer``
(a `flashrt.profile.StageTimer`; the runner's own when None): "validate" (every check; InputError
before any buffer is touched) -> "h2d" (the bucket picked, the inputs written) -> "replay" -> "d2h"
(the audio copied to the host; the static buffer is reused by the next call).

Streaming ``runner.stream(chunks) -> iterator of (B, n) audio``. Chunks may cut the signal anywhere:
steps that do not yet make a whole frame in every input (a coarse code whose finer codes have not
come, half an attention window) are held until they do. Whole frames are decoded ``chunk`` at a time
in windows of ``L + chunk + R`` frames (L, R = the frontend's context). With ``max_chunk`` above
``chunk`` the windows grow once the stream has started (`ChunkSchedule`: each window decodes as many
frames as the stream has already emitted, from ``chunk`` up to ``max_chunk``): the first audio comes
as early, and a long stream decodes fewer, longer windows (less overlap: a 4-frame chunk with 6 frames
of context a side decodes 4x the frames it keeps). A window keeps only the
outputs at least R frames from an artificial right edge and L from an artificial left edge; at the
real start and end of the signal the window edges are the signal edges, so the concatenated stream
equals the one-shot output up to float summation order. When the chunks run out, the held steps must
be whole frames of every input (as a one-shot call's must), else InputError.

Summation order and ``exact_stream``. oneDNN's dilated and transposed convolutions (and block-spectral
convs) lay their work out from the start of the tensor, so a window of W frames and a one-shot run of T
frames can round differently at the same sample (see `flashrt.nn.conv_policy` for the position-
invariant policy that removes this). With ``exact_stream=True`` a one-shot call decodes through the
very windows the stream would (same shapes, same positions, same kernels), so ``stream()`` equals it
bit for bit, at the cost of the windows' overlap ((L + chunk + R) / chunk more compute) and with no
length limit but the batch.

`report()` gives the last call's compute time (sum of its stages), real-time factor (compute / audio
duration) and, for a stream, the time to first audio: from the first chunk handed over to the first
audio chunk on the host (the timer's clock). Time spent waiting for the producer or the consumer
between chunks is excluded from compute but included in the time to first audio.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashrt.errors import ConfigError, InputError
from flashrt.profile import StageTimer
from flashrt.runtime.frontend import ChunkSchedule, StreamFrontend, Window

__all__ = ["StreamRunner", "Stream", "FrameQueue", "ChunkSchedule"]


@dataclass
class _RunLog:
    """Timing of the last call or stream: its stages are the timer's records from index `first` on."""

    mode: str
    timer: StageTimer
    first: int = 0
    frames: int = 0
    windows: int = 0


class FrameQueue:
    """Steps received but not yet decoded, for one stream: partial frames are held, and only what later
    windows still need is kept. Frames are counted from the start of the signal."""

    def __init__(self, rates: Sequence[int], context: tuple[int, int], schedule: ChunkSchedule) -> None:
        self.rates, self.schedule = tuple(rates), schedule
        self.left, self.right = context
        self.parts: list[list[torch.Tensor]] = [[] for _ in self.rates]
        self.steps = [0] * len(self.rates)   # steps received, per input
        self.base = 0       # frame index of the first frame held
        self.total = 0      # whole frames received (in every input)
        self.emitted = 0    # frames whose audio was yielded
        self.batch: int | None = None

    def push(self, tensors: Sequence[torch.Tensor]) -> None:
        batch = tensors[0].shape[0]
        if self.batch is None:
            self.batch = batch
        elif batch != self.batch:
            raise InputError(f"chunk batch {batch} differs from the stream's batch {self.batch}")
        for i, t in enumerate(tensors):
            if t.shape[-1]:
                self.parts[i].append(t)
                self.steps[i] += t.shape[-1]
        self.total = min(s // r for s, r in zip(self.steps, self.rates))

    def close(self) -> None:
        """No more input: what is held must be whole frames of every input."""
        if any(s != self.total * r for s, r in zip(self.steps, self.rates)):
            raise InputError(f"the stream ended with steps {self.steps} per input, which are not one whole "
                             f"number of frames at the rates {list(self.rates)}")

    @property
    def chunk(self) -> int:
        """Frames the next window decodes (`ChunkSchedule`)."""
        return self.schedule.chunk(self.emitted)

    def ready(self) -> bool:
        return self.total - self.emitted >= self.chunk + self.right

    def pending(self) -> bool:
        return self.emitted < self.total

    def next_window(self, final: bool) -> tuple[int, int, int]:
        """(start, stop, keep_until) frames: decode [start, stop), keep the audio of [emitted, keep)."""
        start, chunk = max(0, self.emitted - self.left), self.chunk
        stop = min(self.total, self.emitted + chunk + self.right)
        keep = self.total if final and stop == self.total else self.emitted + chunk
        return start, stop, keep

    def slice(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        out = []
        for i, rate in enumerate(self.rates):
            joined = torch.cat(self.parts[i], dim=-1) if len(self.parts[i]) > 1 else self.parts[i][0]
            self.parts[i] = [joined]
            out.append(joined[..., (start - self.base) * rate:(stop - self.base) * rate])
        return tuple(out)

    def advance(self, keep: int) -> None:
        """Mark [emitted, keep) decoded and drop frames no later window reaches."""
        self.emitted = keep
        drop = max(0, keep - self.left) - self.base
        if drop > 0:
            for i, rate in enumerate(self.rates):
                self.parts[i] = [self.parts[i][0][..., drop * rate:]]
            self.base += drop


class StreamRunner:
    """One-shot and streaming decode over a captured `StreamFrontend` (module docstring). ``chunk``:
    frames decoded per stream window (each window holds ``context[0] + chunk + context[1]`` frames);
    ``max_chunk`` (None: ``chunk``): the most a later window decodes (`ChunkSchedule`)."""

    def __init__(self, frontend: StreamFrontend, chunk: int, *, max_chunk: int | None = None,
                 exact_stream: bool = False) -> None:
        self.frontend = frontend
        self.exact_stream = bool(exact_stream)
        self._last: _RunLog | None = None
        self._lock = threading.Lock()   # one window at a time through the frontend's static buffers
        if int(chunk) <= 0:
            raise ConfigError(f"stream_chunk ({chunk}) must be positive")
        self.schedule = ChunkSchedule(int(chunk), int(chunk) if max_chunk is None else int(max_chunk))

    @property
    def stream_chunk(self) -> int:
        """Frames the first stream window decodes."""
        return self.schedule.first

    @property
    def max_stream_chunk(self) -> int:
        """Frames the longest stream window decodes."""
        return self.schedule.limit

    @property
    def stream_window(self) -> int:
        """Frames of the longest stream window."""
        left, right = self.frontend.context
        return left + self.schedule.limit + right

    @property
    def stream_windows(self) -> tuple[int, ...]:
        """Frames of every full stream window (`ChunkSchedule.sizes` plus the context)."""
        left, right = self.frontend.context
        return tuple(left + chunk + right for chunk in self.schedule.sizes())

    # ------------------------------------------------------------------------------ one-shot
    def __call__(self, *inputs: Any, timer: StageTimer | None = None) -> torch.Tensor:
        """One-shot decode of the whole signal -> audio (B, N) float32 on the host."""
        log = self._start("call", timer)
        fe = self.frontend
        with log.timer.stage("validate"):
            frames, tensors = fe.check(inputs)
            if not self.exact_stream and frames > fe.max_frames:
                raise InputError(f"{frames} frames exceed the largest bucket {fe.max_frames}; load with "
                                 f"larger buckets=... or decode with stream()")
        if self.exact_stream:
            queue = self._queue()
            queue.push(tensors)
            audio = torch.cat(list(self._windows(log, queue)), dim=-1)
        else:
            audio = self._decode(log, Window(tuple(tensors), frames, 0, 0, fe.samples(frames)))
        log.frames = frames
        return audio

    def _start(self, mode: str, timer: StageTimer | None = None) -> _RunLog:
        timer = timer if timer is not None else StageTimer(self.frontend.device, nvtx=True)
        self._last = _RunLog(mode, timer, first=len(timer))
        return self._last

    def _queue(self) -> FrameQueue:
        return FrameQueue(self.frontend.rates, self.frontend.context, self.schedule)

    def _decode(self, log: _RunLog, window: Window) -> torch.Tensor:
        """Write, replay and read one window; its audio samples [lo, hi) on the host. Windows are
        serialized (a lock around the three): calls and streams from several threads, or several
        streams interleaved in one thread, each get their own audio (a stream's state is its own)."""
        fe = self.frontend
        with self._lock:
            with log.timer.stage("h2d"):
                bucket = fe.bucket(window.frames)
                fe.write(bucket, window)
            with log.timer.stage("replay"), torch.inference_mode():
                fe.replay(bucket)
            with log.timer.stage("d2h"):
                audio = fe.read(window)
        log.windows += 1
        return audio

    # ------------------------------------------------------------------------------ streaming
    def stream(self, chunks: Iterable[Any], timer: StageTimer | None = None) -> Iterator[torch.Tensor]:
        """Decode chunks as they arrive; yields host audio chunks (B, n) whose concatenation equals the
        one-shot output. Each item of `chunks` is one input tensor, or a tuple with one per input (any
        number of steps each). ``timer`` receives "validate" per chunk, h2d/replay/d2h per window."""
        stream = self.open(timer)
        for chunk in chunks:
            yield from stream.push(chunk)
        yield from stream.close()

    def open(self, timer: StageTimer | None = None) -> Stream:
        """One stream's state, fed a chunk at a time (`stream` is the iterator form): for a caller that
        serves many streams from one thread (a batched chain stage)."""
        return Stream(self, self._queue(), self._start("stream", timer))

    def _windows(self, log: _RunLog, queue: FrameQueue) -> Iterator[torch.Tensor]:
        """Every window still due once all input is in: the ready ones, then the final ones."""
        queue.close()
        while queue.ready():
            yield self._window(log, queue, final=False)
        while queue.pending():
            yield self._window(log, queue, final=True)

    def _window(self, log: _RunLog, queue: FrameQueue, final: bool) -> torch.Tensor:
        start, stop, keep = queue.next_window(final)
        hop, fe = self.frontend.hop, self.frontend
        lo = (queue.emitted - start) * hop
        hi = fe.samples(stop - start) if final and keep == queue.total else (keep - start) * hop
        audio = self._decode(log, Window(queue.slice(start, stop), stop - start, start, lo, hi))
        queue.advance(keep)
        return audio

    def decode_together(self, streams: Sequence[Stream], stack: bool = True) -> None:
        """Decode every window due in ``streams`` (after their `Stream.feed` / `Stream.finish`): one
        window per stream at a time, windows of the same length stacked as rows of one replay (up to
        the frontend's batch; ``stack=False``: one replay each). Each window's audio is appended to its
        stream's ``audio`` as soon as its replay is read, so a failure later leaves it there."""
        while due := [s for s in streams if s.due()]:
            groups: dict[int, list[tuple[Stream, tuple[int, int, int, bool]]]] = {}
            for st in due:
                final = not st.queue.ready()
                start, stop, keep = st.queue.next_window(final)
                groups.setdefault(stop - start, []).append((st, (start, stop, keep, final)))
            for frames, members in groups.items():
                rows = self._max_rows(frames) if stack else 1
                for i in range(0, len(members), rows):
                    self._decode_rows(frames, members[i:i + rows])

    def _max_rows(self, frames: int) -> int:
        max_rows = getattr(self.frontend, "max_rows", None)
        return max_rows(frames) if callable(max_rows) else self.frontend.batch

    def _decode_rows(self, frames: int, members: list[tuple[Stream, tuple[int, int, int, bool]]]) -> None:
        """One replay of windows of ``frames`` frames, one per row; each row's samples to its stream."""
        hop, fe = self.frontend.hop, self.frontend
        parts = [st.queue.slice(start, stop) for st, (start, stop, _, _) in members]
        inputs = tuple(torch.cat(level, dim=0) for level in zip(*parts))
        first_start = members[0][1][0]
        log = members[0][0].log
        audio = self._decode(log, Window(inputs, frames, first_start, 0, fe.samples(frames)))
        for row, (st, (start, stop, keep, final)) in enumerate(members):
            lo = (st.queue.emitted - start) * hop
            hi = fe.samples(stop - start) if final and keep == st.queue.total else (keep - start) * hop
            st.audio.append(audio[row:row + 1, lo:hi])
            st.queue.advance(keep)
            if st is not members[0][0]:
                st.log.windows += 1

    # ------------------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """Timing of the last call/stream: compute_ms, audio_s, rtf, ttfa_ms (stream), windows, graphs."""
        if self._last is None:
            return {}
        log, fe = self._last, self.frontend
        records = log.timer.records(log.first)
        compute = sum(r.ms for r in records)
        audio_s = fe.samples(log.frames) / fe.sample_rate if log.frames else 0.0
        out = {"mode": log.mode, "frames": log.frames, "windows": log.windows, "compute_ms": compute,
               "audio_s": audio_s, "rtf": compute / 1e3 / audio_s if audio_s else None}
        reads = [r for r in records if r.stage == "d2h"]
        if log.mode == "stream" and reads:
            out["ttfa_ms"] = reads[0].end_ms - records[0].start_ms
        out["graphs"] = fe.report()
        return out


class Stream:
    """One stream of a `StreamRunner` (`StreamRunner.open`): ``push(chunk)`` checks and queues the
    chunk at once and returns an iterator over the windows it made ready (decode them before the next
    push); ``close()`` the iterator over the final windows. Together they give `StreamRunner.stream`.

    Several streams decoded together (`StreamRunner.decode_together`): ``feed(chunk)`` and
    ``finish()`` only queue; the runner then decodes the windows due in every stream, stacking windows
    of the same length into one replay (rows), and each stream collects its audio (``take()``)."""

    def __init__(self, runner: StreamRunner, queue: FrameQueue, log: _RunLog) -> None:
        self.runner, self.queue, self.log = runner, queue, log
        self.closing = False
        self.audio: list[torch.Tensor] = []  # decoded by `decode_together`, not yet taken

    def push(self, chunk: Any) -> Iterator[torch.Tensor]:
        self.feed(chunk)
        return self._ready()

    def feed(self, chunk: Any) -> None:
        """Check and queue a chunk (InputError before anything is queued); decode nothing."""
        with self.log.timer.stage("validate"):
            values = chunk if isinstance(chunk, (list, tuple)) else (chunk,)
            _, tensors = self.runner.frontend.check(values, partial=True)
            self.queue.push(tensors)

    def finish(self) -> None:
        """No more input (the held steps must be whole frames): the final windows become due."""
        if not self.closing:
            self.queue.close()
            self.closing = True

    def due(self) -> bool:
        return self.queue.ready() or (self.closing and self.queue.pending())

    def take(self) -> list[torch.Tensor]:
        audio, self.audio = self.audio, []
        if self.closing and not self.queue.pending():
            self.log.frames = self.queue.total
        return audio

    def _ready(self) -> Iterator[torch.Tensor]:
        while self.queue.ready():
            yield self.runner._window(self.log, self.queue, final=False)

    def close(self) -> Iterator[torch.Tensor]:
        yield from self.runner._windows(self.log, self.queue)
        self.log.frames = self.queue.total
