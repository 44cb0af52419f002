"""The `Vocoder` frontend shared by every vocoder family: static buffers, length buckets, streaming.

A family (see `flashrt.frontends.vocoders` for the registry) supplies a module whose forward is

    module(*inputs, valid=EXACT[, offset=...]) -> (B, N) audio, N = frames * hop_length - trim_samples

with one tensor per `FeatureInput` of its `VocoderSignature` (float features (B, C, T*rate) or integer
codes (B, T*rate)), and ``valid`` a `flashrt.nn.audio.ValidLength` saying how many of the padded frames
are real (blocks mask or hold the padding so the real part equals an unpadded run), or `EXACT` when
nothing is padded. A module whose forward takes ``offset`` also gets the static ``offset`` buffer: the
absolute frame index of the first frame it decodes (0 for one-shot, the window start when streaming),
so position-dependent parts (SNAC's seeded noise) see the positions of the whole signal.

Shape legend: B batch, C feature channels, K codebooks, T frames, N audio samples, W stream window frames.

Buffers (allocated once by `capture()`, sized for the largest bucket):
    <input name>  input   (B, C, Tmax*rate) or (B, Tmax*rate)   features / codes, zero past the length
    length        input   (1,) int64                           valid frames of the current request
    offset        input   (1,) int64                           absolute index of the first frame
    audio         output  (B, Nmax) float32                    waveform written by the graph

Hot path, one-shot ``vocoder(features, timer=None) -> (B, N)`` float32 on the host, each phase a stage
of ``timer`` (a `flashrt.profile.StageTimer`; the vocoder's own when None): "validate" (layout, dtype,
range, finiteness, size; InputError before any buffer is touched) -> "h2d" (pad to the bucket, populate)
-> "replay" (the smallest bucket graph that fits) -> "d2h" (the audio copied to the host; the static
buffer is reused by the next call). On the eager backend a request that fills its bucket exactly runs
with `EXACT` (no padding to fix up); the trace and cuda graphs always read ``length``.

Codes: an integer input is (B, T*rate) (or (T*rate,)); a family with K code inputs of one rate (Vocos
EnCodec: one per codebook) also takes them stacked as ONE (B, K, T) integer tensor (EnCodec's layout).

Streaming ``vocoder.stream(chunks) -> iterator of (B, n) audio``: frames are decoded ``chunk`` at a
time in windows of ``L + chunk + R`` frames (L, R = the family's receptive field in frames, rounded
up). A window keeps only the outputs at least R frames from an artificial right edge and L from an
artificial left edge; at the real start and end of the signal the window edges are the signal edges,
padded exactly like the one-shot run. So the concatenated stream equals the one-shot output up to float
summation order, and the window length is one of the captured buckets.

Summation order, the ``invariant`` conv policy, and ``exact_stream``. oneDNN's dilated and transposed
convolutions (and the block-spectral convs of the ``auto`` policy) lay their work out from the start of
the tensor, so a window of W frames and a one-shot run of T frames can round differently at the same
sample. BigVGAN's default conv policy, ``invariant`` (`flashrt.nn.conv_policy`), removes every such
dependence (dilated convs phase-split, upsamplers polyphase, the resamplers' edge terms added at the
real end of the data exactly as at the end of a tensor), so its stream equals the one-shot output bit
for bit at any size (measured: BigVGAN-base, 200 frames, chunk 32: 0; with ``conv="direct"`` 1.6e-5, as
its snake activations amplify 1e-7 rounding differences through ~90 convs). The other families keep
the faster ``auto`` policy: measured streaming (chunk 32) vs one-shot (200 frames) at the released
sizes: HiFi-GAN V1 4e-7, Vocos mel and SNAC 24 kHz 0. With ``exact_stream=True`` a one-shot call
decodes through the very windows the stream would (same shapes, same positions, same kernels), so
``stream()`` equals it bit for bit for every family and policy, at the cost of the windows' overlap
((L + chunk + R) / chunk more compute) and with no length limit but the batch.

`report()` gives the last call's compute time (sum of its stages), real-time factor (compute / audio
duration) and, for a stream, the time to first audio: from the first chunk handed over to the first
audio chunk on the host (the timer's clock: the device's on CUDA, perf_counter_ns on CPU). Time spent
waiting for the producer or the consumer between chunks is excluded from compute but included in the
time to first audio.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from flashrt.errors import ConfigError, InputError
from flashrt.nn.audio import EXACT, ValidLength
from flashrt.nn.spectral_conv import SpectralPlan, spectral_bytes
from flashrt.profile import StageTimer
from flashrt.runtime.buckets import GraphSet, pad_to
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import get_backend

__all__ = ["FeatureInput", "VocoderSignature", "VocoderFamily", "CheckpointSource", "Vocoder",
           "DEFAULT_BUCKETS", "DEFAULT_STREAM_CHUNK", "check_inputs"]

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
    conv: str = "auto"                      # default `flashrt.nn.conv_policy` name on the CPU


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


def as_tuples(value: Any) -> Any:
    """JSON lists (nested too) as tuples, for frozen config dataclasses read from config files."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_upsampler_pairs(family: str, cfg: Any) -> None:
    """HiFi-GAN-style generators: upsample rates/kernels and resblock kernels/dilations come in pairs."""
    if len(cfg.upsample_rates) != len(cfg.upsample_kernel_sizes) or \
            len(cfg.resblock_kernel_sizes) != len(cfg.resblock_dilation_sizes):
        raise ConfigError(f"{family}: upsample rates/kernels and resblock kernels/dilations must pair up")


def check_inputs(signature: VocoderSignature, values: Sequence[Any]) -> tuple[list[torch.Tensor], int]:
    """All inputs checked (nothing touched); returns them and the number of frames they span."""
    if len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    values = _ungroup(signature, values)
    if len(values) != len(signature.inputs):
        names = [s.name for s in signature.inputs]
        raise InputError(f"expected {len(names)} input(s) {names}, got {len(values)}")
    tensors = [_check_one(spec, v) for spec, v in zip(signature.inputs, values)]
    return tensors, _frames(signature, tensors)


def _groupable(signature: VocoderSignature) -> bool:
    """K > 1 code inputs of one rate and range (e.g. one per EnCodec codebook) can come stacked."""
    specs = signature.inputs
    return len(specs) > 1 and all(s.is_codes and (s.rate, s.high) == (specs[0].rate, specs[0].high)
                                  for s in specs)


def _ungroup(signature: VocoderSignature, values: Sequence[Any]) -> Sequence[Any]:
    """One stacked (B, K, T) integer tensor -> its K rows (B, T); anything else unchanged. (An unbatched
    (K, T) would read as K separate inputs' batch, so the stacked form always carries B.)"""
    stacked = len(values) == 1 and isinstance(values[0], (torch.Tensor, np.ndarray)) and values[0].ndim == 3
    if not stacked or not _groupable(signature):
        return values
    k, t = len(signature.inputs), _as_tensor("codes", values[0])
    if t.shape[1] != k:
        raise InputError(f"codes: expected (B, {k}, T) stacked codes (one row per codebook "
                         f"{[s.name for s in signature.inputs]}), got shape {tuple(t.shape)}")
    return t.unbind(1)


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
    """Timing of the last call or stream: its stages are the timer's records from index `first` on."""

    mode: str
    timer: StageTimer
    first: int = 0
    frames: int = 0
    windows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Vocoder:
    """One loaded vocoder, ready for one-shot and streaming decode (see module docstring).

    Constructed by `load_vocoder` (which calls `capture()`); the constructor only stores its
    arguments. ``buckets`` are frame counts; the stream window ``L + stream_chunk + R`` is added.
    ``exact_stream``: one-shot calls decode through the stream's windows (bit-for-bit equal to
    `stream`, more compute; see the module docstring).
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
        exact_stream: bool = False,
    ) -> None:
        self.family, self.config, self.module = family, config, module
        self.device = torch.device(device)
        self.backend_name = backend or ("cuda" if self.device.type == "cuda" else "eager")
        self.signature = family.signature(config)
        self.stream_chunk = int(stream_chunk or family.default_stream_chunk)
        self.buckets = tuple(sorted({*(buckets or family.default_buckets), self.stream_window}))
        self.batch, self.strict, self.dtype = int(batch), strict, dtype
        self.exact_stream = bool(exact_stream)
        self.takes_offset = "offset" in inspect.signature(module.forward).parameters
        self.buffers: Buffers | None = None
        self.graphs: GraphSet | None = None
        self._last: _RunLog | None = None
        self._host_length = 0  # valid frames of the request being replayed (eager: EXACT when full)
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
        specs.append(BufferSpec("offset", (1,), torch.int64, "input", low=0,
                                doc="absolute index of the first frame (0 one-shot, window start streaming)"))
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
        """The captured function of one bucket: reads views of the input buffers, writes `audio`.

        On the eager backend (a plain call per replay, nothing recorded) a request of exactly `frames`
        frames runs the `EXACT` variant, skipping the padding fix-ups, which would have nothing to do."""
        padded = self._bucket_fn(frames, exact=False)
        if self.backend_name != "eager":
            return padded
        exact = self._bucket_fn(frames, exact=True)
        return lambda: (exact if self._host_length == frames else padded)()

    def _bucket_fn(self, frames: int, exact: bool) -> Callable[[], None]:
        bufs = self.buffers
        inputs = [bufs[s.name][..., :frames * s.rate] for s in self.signature.inputs]
        out, length = bufs["audio"][:, :self.signature.samples(frames)], bufs["length"]
        extra = {"offset": bufs["offset"]} if self.takes_offset else {}

        def run() -> None:
            out.copy_(self.module(*inputs, valid=EXACT if exact else ValidLength(length, frames), **extra))
        return run

    # ------------------------------------------------------------------------------ hot path
    def __call__(self, *inputs: Any, timer: StageTimer | None = None) -> torch.Tensor:
        """One-shot decode: features (B, C, T) or (C, T) (codes: (B, T) or (T), or stacked (B, K, T))
        -> audio (B, N) float32 on the host. ``timer`` receives the stages (module docstring)."""
        log = self._start("call", timer)
        with log.timer.stage("validate"):
            tensors, frames = check_inputs(self.signature, inputs)
            self._check_size(tensors[0].shape[0], None if self.exact_stream else frames)
        if self.exact_stream:
            state = _StreamState(self.signature, self.stream_chunk)
            state.push(tensors, frames)
            audio = torch.cat(list(self._windows(log, state)), dim=-1)
        else:
            audio = self._decode(log, tensors, frames, 0, self.signature.samples(frames), offset=0)
        log.frames = frames
        return audio

    def _start(self, mode: str, timer: StageTimer | None = None) -> _RunLog:
        if self.graphs is None:
            raise ConfigError("vocoder not captured yet: call capture() (load_vocoder does)")
        timer = timer if timer is not None else StageTimer(self.device, nvtx=True)
        self._last = _RunLog(mode, timer, first=len(timer))
        return self._last

    def _check_size(self, batch: int, frames: int | None) -> None:
        if batch > self.batch:
            raise InputError(f"batch {batch} exceeds the captured batch {self.batch} (load with batch=...)")
        if frames is not None and frames > self.max_frames:
            raise InputError(f"{frames} frames exceed the largest bucket {self.max_frames}; load with larger "
                             f"buckets=... or decode with stream()")

    def _decode(self, log: _RunLog, tensors: list[torch.Tensor], frames: int, lo: int, hi: int,
                offset: int) -> torch.Tensor:
        """Run one window of `frames` frames starting at absolute frame `offset`; return its audio samples
        [lo, hi) on the host."""
        batch = tensors[0].shape[0]
        with log.timer.stage("h2d"):
            bucket = self.graphs.bucket_for(frames)
            self.buffers.write(self._padded(tensors, frames, offset))  # values checked by check_inputs
            self._host_length = frames
        with log.timer.stage("replay"), torch.inference_mode():
            self.graphs.replay(bucket)
        with log.timer.stage("d2h"):
            audio = self.buffers["audio"][:batch, lo:hi].to("cpu", copy=True)
        log.windows += 1
        return audio

    def _padded(self, tensors: list[torch.Tensor], frames: int, offset: int) -> dict[str, torch.Tensor]:
        out: dict[str, Any] = {"length": torch.tensor([frames], dtype=torch.int64),
                               "offset": torch.tensor([offset], dtype=torch.int64)}
        for spec, t in zip(self.signature.inputs, tensors):
            t = t.to(device=self.device, dtype=torch.int64 if spec.is_codes else self.dtype)
            t = pad_to(pad_to(t, self.max_frames * spec.rate, dim=-1), self.batch, dim=0)
            out[spec.name] = t
        return out

    # ------------------------------------------------------------------------------ streaming
    def stream(self, chunks: Iterable[Any], timer: StageTimer | None = None) -> Iterator[torch.Tensor]:
        """Decode feature chunks as they arrive; yields host audio chunks (B, n) whose concatenation equals
        the one-shot output. Each item of `chunks` is one input tensor (or a tuple, one per input; codes
        may come stacked). ``timer`` receives the stages ("validate" per chunk, h2d/replay/d2h per window).
        """
        state = _StreamState(self.signature, self.stream_chunk)
        log = self._start("stream", timer)
        for chunk in chunks:
            with log.timer.stage("validate"):
                values = chunk if isinstance(chunk, (list, tuple)) else (chunk,)
                tensors, frames = check_inputs(self.signature, values)
                self._check_size(tensors[0].shape[0], None)
                state.push(tensors, frames)
            while state.ready():
                yield self._stream_window(log, state, final=False)
        yield from self._windows(log, state)
        log.frames = state.total

    def _windows(self, log: _RunLog, state: _StreamState) -> Iterator[torch.Tensor]:
        """Every window still due once all input is in: the ready ones, then the final ones."""
        while state.ready():
            yield self._stream_window(log, state, final=False)
        while state.pending():
            yield self._stream_window(log, state, final=True)

    def _stream_window(self, log: _RunLog, state: _StreamState, final: bool) -> torch.Tensor:
        start, stop, keep = state.next_window(final)
        hop, sig = self.signature.hop_length, self.signature
        lo = (state.emitted - start) * hop
        hi = sig.samples(stop - start) if final and keep == state.total else (keep - start) * hop
        audio = self._decode(log, state.slice(start, stop), stop - start, lo, hi, offset=start)
        state.advance(keep)
        return audio

    # ------------------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """Timing of the last call/stream: compute_ms, audio_s, rtf, ttfa_ms (stream), windows, buckets."""
        if self._last is None:
            return {}
        log = self._last
        records = log.timer.records(log.first)
        compute = sum(r.ms for r in records)
        audio_s = self.signature.samples(log.frames) / self.signature.sample_rate if log.frames else 0.0
        out = {"mode": log.mode, "frames": log.frames, "windows": log.windows, "compute_ms": compute,
               "audio_s": audio_s, "rtf": compute / 1e3 / audio_s if audio_s else None}
        reads = [r for r in records if r.stage == "d2h"]
        if log.mode == "stream" and reads:
            out["ttfa_ms"] = reads[0].end_ms - records[0].start_ms
        out["graphs"] = self.graphs.report() if self.graphs is not None else {}
        return out

    def describe(self) -> str:
        sig, nbytes = self.signature, self.buffers.nbytes() if self.buffers else 0
        exact = ", one-shot through the stream windows" if self.exact_stream else ""
        spectral = sum(1 for m in self.module.modules() if isinstance(m, SpectralPlan))
        split = sum(1 for m in self.module.modules() if getattr(m, "phase_split", False))
        convs = f", {spectral} spectral convs ({spectral_bytes(self.module):,d} bytes)" if spectral else ""
        convs += f", {split} phase-split dilated convs (position-invariant)" if split else ""
        return (f"{self.family.name} vocoder: {sig.sample_rate} Hz, hop {sig.hop_length}, context "
                f"{sig.context} frames, buckets {list(self.buckets)}, stream chunk {self.stream_chunk}"
                f"{exact}, backend {self.backend_name}, {nbytes:,d} buffer bytes{convs}")


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
