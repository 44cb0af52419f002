"""The `Vocoder` frontend shared by every vocoder family: static buffers, length buckets, streaming.

A family (see `flashrt.frontends.vocoders` for the registry) supplies a module whose forward is

    module(*inputs, valid=EXACT) -> (B, N) audio, N = frames * hop_length - trim_samples

with one tensor per `FeatureInput` of its `VocoderSignature` (float features (B, C, T*rate) or integer
codes (B, T*rate)), and ``valid`` a `flashrt.nn.audio.ValidLength` saying how many of the padded frames
are real (blocks mask or hold the padding so the real part equals an unpadded run).

Shape legend: B batch, C feature channels, T frames, N audio samples, W stream window frames.

Buffers (allocated once by `capture()`, sized for the largest bucket):
    <input name>  input   (B, C, Tmax*rate) or (B, Tmax*rate)   features / codes, zero past the length
    length        input   (1,) int64                           valid frames of the current request
    audio         output  (B, Nmax) float32                    waveform written by the graph

Hot path, one-shot ``vocoder(features) -> (B, N)``: validate (InputError before any buffer is touched)
-> pad to the largest bucket -> populate -> replay the smallest bucket graph that fits -> copy out.

Streaming ``vocoder.stream(chunks) -> iterator of (B, n) audio``: frames are decoded ``chunk`` at a
time in windows of ``L + chunk + R`` frames (L, R = the family's receptive field in frames, rounded
up). A window keeps only the outputs at least R frames from an artificial right edge and L from an
artificial left edge; at the real start and end of the signal the window edges are the signal edges,
padded exactly like the one-shot run. So the concatenated stream equals the one-shot output (same
kernels on the same values; only float summation order may differ). The window length is one of the
captured buckets, so streaming replays the same kind of graph as one-shot.

Timing comes from `flashrt.profile.StageTimer` (stages "accept" (stream only: check and queue a
chunk), "prepare", "replay", "read"); `report()` gives the last call's compute time (sum of the stages),
real-time factor (compute / audio duration) and, for a stream, the time to first audio: from the moment
the first chunk was handed over to the moment the first audio chunk is ready (the timer's clock: the
device's on CUDA, perf_counter_ns on CPU). Time spent waiting for the producer or the consumer between
chunks is excluded from compute but included in the time to first audio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from flashrt.errors import ConfigError, InputError
from flashrt.nn.audio import ValidLength
from flashrt.profile import StageTimer
from flashrt.runtime.buckets import GraphSet, pad_to
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import get_backend

__all__ = ["FeatureInput", "VocoderSignature", "VocoderFamily", "CheckpointSource", "Vocoder",
           "DEFAULT_BUCKETS", "DEFAULT_STREAM_CHUNK"]

DEFAULT_BUCKETS = (64, 256, 1024)
DEFAULT_STREAM_CHUNK = 32


@dataclass(frozen=True)
class FeatureInput:
    """One model input. Float features are (B, channels, T*rate); integer codes (channels=None) (B, T*rate).

    ``rate`` is the number of steps of this input per frame (SNAC's finer code levels have 2, 4);
    ``high`` bounds integer codes (codebook size - 1).
    """

    name: str = "features"
    channels: int | None = 80
    rate: int = 1
    high: int | None = None

    @property
    def is_codes(self) -> bool:
        return self.channels is None


@dataclass(frozen=True)
class VocoderSignature:
    """What a family's module consumes and produces, and how far its outputs look around."""

    inputs: tuple[FeatureInput, ...]
    hop_length: int
    sample_rate: int
    context: tuple[int, int]          # (left, right) receptive field in whole frames
    trim_samples: int = 0             # audio samples = frames * hop_length - trim_samples

    def samples(self, frames: int) -> int:
        return frames * self.hop_length - self.trim_samples


@dataclass(frozen=True)
class CheckpointSource:
    """What detection sees: the path (None for in-memory weights), its config.json, the checkpoint keys."""

    path: Any
    config: Mapping[str, Any] | None
    keys: frozenset[str]


@dataclass(frozen=True)
class VocoderFamily:
    """A registry entry (see `flashrt.frontends.vocoders.register_vocoder`)."""

    name: str
    presets: Mapping[str, Any]
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    build: Callable[[Any], nn.Module]
    weight_map: Callable[[Any, Mapping[str, torch.Tensor]], Any]
    signature: Callable[[Any], VocoderSignature]
    detect: Callable[[CheckpointSource], bool]
    default_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    default_stream_chunk: int = DEFAULT_STREAM_CHUNK
    doc: str = ""


# ------------------------------------------------------------------------------------------- input

def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype != object:
        return torch.from_numpy(np.ascontiguousarray(value))
    raise InputError(f"{name}: expected a tensor or numpy array, got {type(value).__name__}")


def _check_one(spec: FeatureInput, value: Any) -> torch.Tensor:
    """One input as (B, C, T) / (B, T), checked for layout, dtype, size and finiteness."""
    t = _as_tensor(spec.name, value)
    want = 2 if spec.is_codes else 3
    if t.dim() == want - 1:
        t = t.unsqueeze(0)
    layout = "(B, T) codes" if spec.is_codes else f"(B, {spec.channels}, T) features"
    if t.dim() != want:
        raise InputError(f"{spec.name}: expected {layout}, got shape {tuple(t.shape)}")
    if not spec.is_codes and t.shape[1] != spec.channels:
        raise InputError(f"{spec.name}: expected {spec.channels} channels (mel bins) in dim 1, "
                         f"got {t.shape[1]} (shape {tuple(t.shape)})")
    if t.shape[-1] == 0 or t.shape[0] == 0:
        raise InputError(f"{spec.name}: empty input (shape {tuple(t.shape)})")
    return _check_values(spec, t)


def _check_values(spec: FeatureInput, t: torch.Tensor) -> torch.Tensor:
    if spec.is_codes:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"{spec.name}: codes must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or (spec.high is not None and hi > spec.high):
            raise InputError(f"{spec.name}: codes must lie in [0, {spec.high}], got [{lo}, {hi}]")
        return t
    if not t.is_floating_point():
        raise InputError(f"{spec.name}: features must be floating point, got {t.dtype}")
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{spec.name}: contains NaN or inf")
    return t


def check_inputs(signature: VocoderSignature, values: Sequence[Any]) -> tuple[list[torch.Tensor], int]:
    """All inputs checked (nothing touched); returns them and the number of frames they span."""
    if len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if len(values) != len(signature.inputs):
        names = [s.name for s in signature.inputs]
        raise InputError(f"expected {len(names)} input(s) {names}, got {len(values)}")
    tensors = [_check_one(spec, v) for spec, v in zip(signature.inputs, values)]
    return tensors, _frames(signature, tensors)


def _frames(signature: VocoderSignature, tensors: list[torch.Tensor]) -> int:
    first = signature.inputs[0]
    frames, rem = divmod(tensors[0].shape[-1], first.rate)
    batch = tensors[0].shape[0]
    for spec, t in zip(signature.inputs, tensors):
        if t.shape[-1] != frames * spec.rate or rem:
            lengths = {s.name: x.shape[-1] for s, x in zip(signature.inputs, tensors)}
            raise InputError(f"input lengths {lengths} do not match the rates "
                             f"{[s.rate for s in signature.inputs]} of one whole number of frames")
        if t.shape[0] != batch:
            raise InputError(f"{spec.name}: batch {t.shape[0]} differs from {first.name}'s {batch}")
    return frames


# ---------------------------------------------------------------------------------------- frontend

@dataclass
class _RunLog:
    """Timing of the last call or stream (device clock through StageTimer)."""

    mode: str
    timer: StageTimer
    frames: int = 0
    windows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Vocoder:
    """One loaded vocoder, ready for one-shot and streaming decode (see module docstring).

    Constructed by `load_vocoder` (which calls `capture()`); the constructor only stores its
    arguments. ``buckets`` are frame counts; the stream window ``L + stream_chunk + R`` is added.
    """

    def __init__(
        self,
        family: VocoderFamily,
        config: Any,
        module: nn.Module,
        *,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        buckets: Sequence[int] | None = None,
        stream_chunk: int | None = None,
        batch: int = 1,
        strict: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.family, self.config, self.module = family, config, module
        self.device = torch.device(device)
        self.backend_name = backend or ("cuda" if self.device.type == "cuda" else "eager")
        self.signature = family.signature(config)
        self.stream_chunk = int(stream_chunk or family.default_stream_chunk)
        self.buckets = tuple(sorted({*(buckets or family.default_buckets), self.stream_window}))
        self.batch, self.strict, self.dtype = int(batch), strict, dtype
        self.buffers: Buffers | None = None
        self.graphs: GraphSet | None = None
        self._last: _RunLog | None = None
        if self.stream_chunk <= 0 or self.batch <= 0:
            raise ConfigError(f"stream_chunk ({self.stream_chunk}) and batch ({self.batch}) must be positive")

    # ------------------------------------------------------------------------------ setup
    @property
    def stream_window(self) -> int:
        left, right = self.signature.context
        return left + self.stream_chunk + right

    @property
    def max_frames(self) -> int:
        return self.buckets[-1]

    def buffer_specs(self) -> list[BufferSpec]:
        """Every static buffer, sized for the largest bucket (see module docstring)."""
        n, specs = self.max_frames, []
        for spec in self.signature.inputs:
            steps = n * spec.rate
            shape = (self.batch, steps) if spec.is_codes else (self.batch, spec.channels, steps)
            dtype = torch.int64 if spec.is_codes else self.dtype
            specs.append(BufferSpec(spec.name, shape, dtype, "input", low=0 if spec.is_codes else None,
                                    high=spec.high, doc="features/codes, zero past `length`"))
        specs.append(BufferSpec("length", (1,), torch.int64, "input", low=1, high=n, doc="valid frames"))
        specs.append(BufferSpec("audio", (self.batch, self.signature.samples(n)), torch.float32, "output",
                                doc="waveform; valid up to length*hop - trim"))
        return specs

    def capture(self) -> Vocoder:
        """Allocate the buffers and capture one graph per bucket (load time, not the hot path)."""
        self.buffers = Buffers(self.buffer_specs(), self.device)
        self.graphs = GraphSet(get_backend(self.backend_name), self._graph_fn, self.buckets,
                               buffers=self.buffers, strict=self.strict)
        self.graphs.capture_all()
        return self

    def _graph_fn(self, frames: int) -> Callable[[], None]:
        """The captured function of one bucket: reads views of the input buffers, writes `audio`."""
        bufs = self.buffers
        inputs = [bufs[s.name][..., :frames * s.rate] for s in self.signature.inputs]
        out, length = bufs["audio"][:, :self.signature.samples(frames)], bufs["length"]

        def run() -> None:
            out.copy_(self.module(*inputs, valid=ValidLength(length, frames)))
        return run

    # ------------------------------------------------------------------------------ hot path
    def __call__(self, *inputs: Any) -> torch.Tensor:
        """One-shot decode: features (B, C, T) or (C, T) (codes: (B, T) or (T)) -> audio (B, N) float32."""
        tensors, frames = check_inputs(self.signature, inputs)
        log = self._start("call")
        audio = self._decode(log, tensors, frames, 0, self.signature.samples(frames))
        log.frames = frames
        return audio

    def _start(self, mode: str) -> _RunLog:
        if self.graphs is None:
            raise ConfigError("vocoder not captured yet: call capture() (load_vocoder does)")
        self._last = _RunLog(mode, StageTimer(self.device, nvtx=True))
        return self._last

    def _decode(self, log: _RunLog, tensors: list[torch.Tensor], frames: int, lo: int,
                hi: int) -> torch.Tensor:
        """Run one window of `frames` frames; return audio samples [lo, hi) of it."""
        batch = tensors[0].shape[0]
        if batch > self.batch:
            raise InputError(f"batch {batch} exceeds the captured batch {self.batch} (load with batch=...)")
        if frames > self.max_frames:
            raise InputError(f"{frames} frames exceed the largest bucket {self.max_frames}; load with larger "
                             f"buckets=... or decode with stream()")
        with log.timer.stage("prepare"):
            bucket = self.graphs.bucket_for(frames)
            self.buffers.populate(self._padded(tensors, frames))
        with log.timer.stage("replay"), torch.inference_mode():
            self.graphs.replay(bucket)
        with log.timer.stage("read"):
            audio = self.buffers["audio"][:batch, lo:hi].clone()
        log.windows += 1
        return audio

    def _padded(self, tensors: list[torch.Tensor], frames: int) -> dict[str, torch.Tensor]:
        out: dict[str, Any] = {"length": torch.tensor([frames], dtype=torch.int64)}
        for spec, t in zip(self.signature.inputs, tensors):
            t = t.to(device=self.device, dtype=torch.int64 if spec.is_codes else self.dtype)
            t = pad_to(pad_to(t, self.max_frames * spec.rate, dim=-1), self.batch, dim=0)
            out[spec.name] = t
        return out

    # ------------------------------------------------------------------------------ streaming
    def stream(self, chunks: Iterable[Any]) -> Iterator[torch.Tensor]:
        """Decode feature chunks as they arrive; yields audio chunks (B, n) whose concatenation equals
        the one-shot output. Each item of `chunks` is one input tensor (or a tuple, one per input)."""
        state = _StreamState(self.signature, self.stream_chunk)
        log = self._start("stream")
        for chunk in chunks:
            with log.timer.stage("accept"):
                values = chunk if isinstance(chunk, (list, tuple)) else (chunk,)
                state.push(*check_inputs(self.signature, values))
            while state.ready():
                yield self._stream_window(log, state, final=False)
        while state.pending():
            yield self._stream_window(log, state, final=True)
        log.frames = state.total

    def _stream_window(self, log: _RunLog, state: _StreamState, final: bool) -> torch.Tensor:
        start, stop, keep = state.next_window(final)
        hop, sig = self.signature.hop_length, self.signature
        lo = (state.emitted - start) * hop
        hi = sig.samples(stop - start) if final and keep == state.total else (keep - start) * hop
        audio = self._decode(log, state.slice(start, stop), stop - start, lo, hi)
        state.advance(keep)
        return audio

    # ------------------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """Timing of the last call/stream: compute_ms, audio_s, rtf, ttfa_ms (stream), windows, buckets."""
        if self._last is None:
            return {}
        log, records = self._last, self._last.timer.records()
        compute = sum(r.ms for r in records)
        audio_s = self.signature.samples(log.frames) / self.signature.sample_rate if log.frames else 0.0
        out = {"mode": log.mode, "frames": log.frames, "windows": log.windows, "compute_ms": compute,
               "audio_s": audio_s, "rtf": compute / 1e3 / audio_s if audio_s else None}
        reads = [r for r in records if r.stage == "read"]
        if log.mode == "stream" and reads:
            out["ttfa_ms"] = reads[0].end_ms - records[0].start_ms
        out["graphs"] = self.graphs.report() if self.graphs is not None else {}
        return out

    def describe(self) -> str:
        sig, nbytes = self.signature, self.buffers.nbytes() if self.buffers else 0
        return (f"{self.family.name} vocoder: {sig.sample_rate} Hz, hop {sig.hop_length}, context "
                f"{sig.context} frames, buckets {list(self.buckets)}, stream chunk {self.stream_chunk}, "
                f"backend {self.backend_name}, {nbytes:,d} buffer bytes")


class _StreamState:
    """Frames received but not yet decoded, for one stream. Keeps only what later windows still need."""

    def __init__(self, signature: VocoderSignature, chunk: int) -> None:
        self.sig, self.chunk = signature, chunk
        self.left, self.right = signature.context
        self.parts: list[list[torch.Tensor]] = [[] for _ in signature.inputs]
        self.base = 0       # frame index of the first frame held
        self.total = 0      # frames received
        self.emitted = 0    # frames whose audio was yielded
        self.batch: int | None = None

    def push(self, tensors: list[torch.Tensor], frames: int) -> None:
        if self.batch is None:
            self.batch = tensors[0].shape[0]
        elif tensors[0].shape[0] != self.batch:
            raise InputError(f"chunk batch {tensors[0].shape[0]} differs from the stream's batch "
                             f"{self.batch}")
        for held, t in zip(self.parts, tensors):
            held.append(t)
        self.total += frames

    def ready(self) -> bool:
        return self.total - self.emitted >= self.chunk + self.right

    def pending(self) -> bool:
        return self.emitted < self.total

    def next_window(self, final: bool) -> tuple[int, int, int]:
        """(start, stop, keep_until) frames: decode [start, stop), keep the audio of [emitted, keep)."""
        start = max(0, self.emitted - self.left)
        stop = min(self.total, self.emitted + self.chunk + self.right)
        keep = self.total if final and stop == self.total else self.emitted + self.chunk
        return start, stop, keep

    def slice(self, start: int, stop: int) -> list[torch.Tensor]:
        out = []
        for i, spec in enumerate(self.sig.inputs):
            joined = torch.cat(self.parts[i], dim=-1) if len(self.parts[i]) > 1 else self.parts[i][0]
            self.parts[i] = [joined]
            out.append(joined[..., (start - self.base) * spec.rate:(stop - self.base) * spec.rate])
        return out

    def advance(self, keep: int) -> None:
        """Mark [emitted, keep) decoded and drop frames no later window reaches."""
        self.emitted = keep
        drop = max(0, keep - self.left) - self.base
        if drop > 0:
            for i, spec in enumerate(self.sig.inputs):
                self.parts[i] = [self.parts[i][0][..., drop * spec.rate:]]
            self.base += drop
