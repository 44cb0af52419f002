"""`VocoderFrontend`: one loaded vocoder's module, static buffers, length buckets and hot-path verbs.

The `flashrt.runtime.frontend.StreamFrontend` of every vocoder family (the module contract is in
`flashrt.frontends.vocoders.base`). A runner (the stream runner, runner/stream.py) drives it one
`Window` at a time:

    frames, tensors = fe.check(inputs[, partial])   layout, dtype, range, finiteness, batch; nothing written
    bucket = fe.bucket(frames)                      the shape this window replays at
    fe.write(bucket, window)                        the only writer of the static inputs
    fe.replay(bucket)                               the decode of that bucket
    audio = fe.read(window)                         its samples [lo, hi) copied to the host

Shape legend: B batch, C feature channels, T frames, N audio samples.

Buffers (allocated once by `capture()`, sized for the largest bucket):
    <input name>  input   (B, C, Tmax*rate) or (B, Tmax*rate)   features / codes of the current window
    length        input   (1,) int64                           valid frames of the current window
    offset        input   (1,) int64                           absolute index of its first frame
    audio         output  (B, Nmax) float32                    waveform written by the decode

Exact length (the eager backend's default, ``exact_length``): nothing is captured, so nothing needs a
static shape. A window of T frames and b rows runs the module on the views ``[:b, ..., :T*rate]`` of
the input buffers with `EXACT` (no padding, no mask, no fix-up) and writes ``audio[:b, :N]``: the call
costs its own length, never its bucket's. Buckets then only bound the buffers (the longest window).

Bucketed (the graph backends: trace, cuda, ...): one graph per bucket reads ``length``; a window is
written into the first T*rate steps, the rest of its bucket zeroed in place (no padded host copy,
no work proportional to the largest bucket), and the module's `ValidLength` fixes up what the padding
would change. Padding costs compute, so without explicit buckets a graph backend captures the family's
bucket range as a geometric ladder (`ladder`: each bucket at most `LADDER_RATIO` times the one below,
so a call computes at most 25 % more frames than its own); the buffers stay sized for the largest
bucket, the graphs of one set share one memory pool on CUDA, and capture time grows with the count.
`describe()` reports the padding of the windows replayed so far (`PaddingLog`) and warns when one
computed more than `PADDING_WARN` (50 %) more frames than its own, e.g. with explicit buckets far apart.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from flashrt import ops
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.vocoders.base import VocoderFamily, check_inputs
from flashrt.nn.alias_free import Activation1d
from flashrt.nn.audio import EXACT, ValidLength
from flashrt.nn.conv_policy import conv_forms
from flashrt.nn.spectral_conv import SpectralPlan, spectral_bytes
from flashrt.runtime.buckets import GraphSet
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.frontend import Window
from flashrt.runtime.graphs import backend_for_device

__all__ = ["VocoderFrontend", "ladder", "LADDER_RATIO", "PaddingLog", "PADDING_WARN"]

LADDER_RATIO = 1.25
PADDING_WARN = 0.5  # describe() warns when a window replays a bucket over 50 % longer than itself


def ladder(buckets: Sequence[int], ratio: float = LADDER_RATIO) -> tuple[int, ...]:
    """The range of `buckets` (smallest to largest) as a geometric ladder: each bucket at most `ratio`
    times the one below."""
    lo, hi = min(buckets), max(buckets)
    sizes = {lo, hi}
    size = lo
    while size < hi:
        size = min(hi, max(size + 1, int(size * ratio)))
        sizes.add(size)
    return tuple(sorted(sizes))


@dataclass
class PaddingLog:
    """Padding of the windows replayed so far, (bucket - frames) / frames each: their count, how many
    exceeded `PADDING_WARN`, the worst one. Owned by one frontend, written by its `write` (under the
    runner's lock), never reset; at the exact length every window's padding is zero."""

    windows: int = 0
    over: int = 0
    worst: float = 0.0
    worst_frames: int = 0
    worst_bucket: int = 0

    def record(self, frames: int, bucket: int) -> None:
        overhead = (bucket - frames) / frames
        self.windows += 1
        self.over += overhead > PADDING_WARN
        if overhead > self.worst:
            self.worst, self.worst_frames, self.worst_bucket = overhead, frames, bucket

    def as_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "over_limit": self.over, "limit": PADDING_WARN,
                "worst_overhead": self.worst, "worst_frames": self.worst_frames,
                "worst_bucket": self.worst_bucket}

    def warnings(self) -> list[str]:
        if not self.over:
            return []
        return [f"{self.over} of {self.windows} window(s) padded by more than {100 * PADDING_WARN:.0f} % "
                f"of their own length (worst: {self.worst_frames} frames replayed at the "
                f"{self.worst_bucket}-frame bucket, +{100 * self.worst:.0f} %); load with a bucket near that "
                "length (buckets=...), or without buckets (a ladder), or on the eager backend (each call at "
                "its own length)"]


class VocoderFrontend:
    """One loaded vocoder (see the module docstring). The constructor only stores; `capture()` allocates
    the buffers and captures the graphs. ``exact_length`` None: on for the eager backend only.
    ``buckets`` None: the family's (a `ladder` over their range on a graph backend); ``extra_buckets``
    are added either way (the stream window)."""

    def __init__(
        self,
        family: VocoderFamily,
        config: Any,
        module: nn.Module,
        *,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        buckets: Sequence[int] | None = None,
        batch: int = 1,
        strict: bool = False,
        dtype: torch.dtype = torch.float32,
        exact_length: bool | None = None,
        extra_buckets: Sequence[int] = (),
        stack_frames: int | None = None,
    ) -> None:
        self.family, self.config, self.module = family, config, module
        self.device = torch.device(device)
        self.backend_name = backend or ("cuda" if self.device.type == "cuda" else "eager")
        self.signature = family.signature(config)
        self.batch, self.strict, self.dtype = int(batch), strict, dtype
        self.exact_length = self.backend_name == "eager" if exact_length is None else bool(exact_length)
        chosen = buckets or (family.default_buckets if self.exact_length else ladder(family.default_buckets))
        self.buckets = tuple(sorted({int(b) for b in (*chosen, *extra_buckets)}))
        self.takes_offset = "offset" in inspect.signature(module.forward).parameters
        self.rates = tuple(s.rate for s in self.signature.inputs)
        self.context = self.signature.context
        self.hop, self.sample_rate = self.signature.hop_length, self.signature.sample_rate
        self.buffers: Buffers | None = None
        self.graphs: GraphSet | None = None          # the full-batch set (rows = batch)
        self.row_sets: dict[int, GraphSet] = {}      # rows bucket -> its set (bucketed path, batch > 1)
        self._rows, self._frames = self.batch, 0     # the window written last (rows, frames)
        self.padding = PaddingLog()
        self.stack_frames = stack_frames  # rows between 1 and batch: only buckets up to this many frames
        if self.batch <= 0 or self.buckets[0] <= 0:
            raise ConfigError(f"batch ({self.batch}) and buckets ({list(self.buckets)}) must be positive")

    # ------------------------------------------------------------------------------ setup
    @property
    def max_frames(self) -> int:
        return self.buckets[-1]

    def samples(self, frames: int) -> int:
        return self.signature.samples(frames)

    def buffer_specs(self) -> list[BufferSpec]:
        """Every static buffer, sized for the largest bucket (see module docstring)."""
        n, specs = self.max_frames, []
        for spec in self.signature.inputs:
            steps = n * spec.rate
            shape = (self.batch, steps) if spec.is_codes else (self.batch, spec.channels, steps)
            dtype = torch.int64 if spec.is_codes else self.dtype
            specs.append(BufferSpec(spec.name, shape, dtype, "input", low=0 if spec.is_codes else None,
                                    high=spec.high, doc="features/codes of the current window"))
        specs.append(BufferSpec("length", (1,), torch.int64, "input", low=1, high=n, doc="valid frames"))
        specs.append(BufferSpec("offset", (1,), torch.int64, "input", low=0,
                                doc="absolute index of the first frame (0 one-shot, window start streaming)"))
        specs.append(BufferSpec("audio", (self.batch, self.samples(n)), torch.float32, "output",
                                doc="waveform; valid up to length*hop - trim"))
        return specs

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Rows a bucketed replay computes: powers of two below ``batch``, and ``batch`` (a window of one
        stream on a batch-8 vocoder replays one row, not eight)."""
        return tuple(sorted({1 << i for i in range(self.batch.bit_length()) if 1 << i < self.batch}
                            | {self.batch}))

    def _row_buckets_of(self, rows: int) -> tuple[int, ...]:
        """The length buckets captured at ``rows`` rows: all of them at one row; at more rows those up to
        ``stack_frames`` (stacked stream windows: no batch-size graphs of a long one-shot's length)."""
        if rows == 1 or self.stack_frames is None:
            return self.buckets
        return tuple(b for b in self.buckets if b <= self.stack_frames) or self.buckets[:1]

    def capture(self) -> VocoderFrontend:
        """Allocate the buffers; capture one graph per (rows, length) bucket unless running at the exact
        length (the graphs of all row buckets share the backend, hence one memory pool on CUDA).
        ``graphs`` is the one-row set (every length bucket)."""
        self.buffers = Buffers(self.buffer_specs(), self.device)
        backend = backend_for_device(self.backend_name, self.device)
        if not self.exact_length:
            for rows in self.row_buckets:
                graphs = GraphSet(backend, partial(self._graph_fn, rows=rows), self._row_buckets_of(rows),
                                  buffers=self.buffers, strict=self.strict)
                self.row_sets[rows] = graphs.capture_all()
            self.graphs = self.row_sets[1]
        return self

    def max_rows(self, frames: int) -> int:
        """How many windows of ``frames`` frames one replay can stack (rows)."""
        if self.exact_length:
            return self.batch
        return max(r for r, gs in self.row_sets.items() if gs.buckets[-1] >= frames or r == 1)

    def _graph_fn(self, frames: int, rows: int | None = None) -> Callable[[], None]:
        """The captured function of one bucket: reads views of the input buffers' first ``rows`` rows,
        writes `audio`. On the eager backend (a plain call per replay) a window filling its bucket runs
        the `EXACT` variant."""
        rows = self.batch if rows is None else rows
        padded = self._bucket_fn(frames, exact=False, rows=rows)
        if self.backend_name != "eager":
            return padded
        exact = self._bucket_fn(frames, exact=True, rows=rows)
        return lambda: (exact if self._frames == frames else padded)()

    def _bucket_fn(self, frames: int, exact: bool, rows: int | None = None) -> Callable[[], None]:
        bufs, rows = self.buffers, self.batch if rows is None else rows
        inputs = [bufs[s.name][:rows, ..., :frames * s.rate] for s in self.signature.inputs]
        out, length = bufs["audio"][:rows, :self.samples(frames)], bufs["length"]
        extra = {"offset": bufs["offset"]} if self.takes_offset else {}

        def run() -> None:
            out.copy_(self.module(*inputs, valid=EXACT if exact else ValidLength(length, frames), **extra))
        return run

    def _run_exact(self, frames: int) -> None:
        """The window written last, at its own length and batch, over views of the buffers."""
        bufs, rows = self.buffers, self._rows
        inputs = [bufs[s.name][:rows, ..., :frames * s.rate] for s in self.signature.inputs]
        extra = {"offset": bufs["offset"]} if self.takes_offset else {}
        with torch.no_grad():
            audio = self.module(*inputs, valid=EXACT, **extra)
        bufs["audio"][:rows, :audio.shape[-1]].copy_(audio)

    # ------------------------------------------------------------------------------ hot path
    def check(self, inputs: Sequence[Any], partial: bool = False) -> tuple[int, list[torch.Tensor]]:
        """(frames, tensors): every input checked (`check_inputs`) and the batch against the buffers."""
        if self.buffers is None:
            raise ConfigError("vocoder not captured yet: call capture() (load_vocoder does)")
        tensors, frames = check_inputs(self.signature, inputs, partial)
        if tensors[0].shape[0] > self.batch:
            raise InputError(f"batch {tensors[0].shape[0]} exceeds the captured batch {self.batch} "
                             "(load with batch=...)")
        return frames, tensors

    def bucket(self, frames: int) -> int:
        """The shape a window of `frames` frames replays at: its own length when running at the exact
        length, else the smallest captured bucket that holds it."""
        if frames > self.max_frames:
            raise InputError(f"{frames} frames exceed the largest bucket {self.max_frames}; load with larger "
                             f"buckets=... or decode with stream()")
        return frames if self.exact_length else self.graphs.bucket_for(frames)

    def write(self, bucket: int, window: Window) -> None:
        """The window's inputs into the first steps of the buffers (values were checked by `check`); on
        the bucketed path the rest of the bucket is zeroed in place."""
        rows = window.inputs[0].shape[0]
        for spec, t in zip(self.signature.inputs, window.inputs):
            buf, steps = self.buffers[spec.name], window.frames * spec.rate
            buf[:rows, ..., :steps].copy_(t)
            if not self.exact_length:
                buf[:rows, ..., steps:bucket * spec.rate].zero_()
                buf[rows:, ..., :bucket * spec.rate].zero_()
        self.buffers["length"].fill_(window.frames)
        self.buffers["offset"].fill_(window.offset)
        self._rows, self._frames = rows, window.frames
        self.padding.record(window.frames, bucket)

    def replay(self, bucket: int) -> None:
        if self.exact_length:
            self._run_exact(bucket)
        else:
            fits = [r for r in self.row_buckets if r >= self._rows and bucket in self.row_sets[r].buckets]
            rows = fits[0] if fits else None
            if rows is None:
                raise InputError(f"{self._rows} rows of {bucket} frames: no graph stacks that many windows "
                                 f"that long (stack_frames={self.stack_frames}); decode them fewer at a time")
            self.row_sets[rows].replay(bucket)

    def read(self, window: Window) -> torch.Tensor:
        """Samples [lo, hi) of the window just replayed, copied to the host (B, hi - lo) float32."""
        hi = self.samples(window.frames) if window.hi is None else window.hi
        return self.buffers["audio"][:window.inputs[0].shape[0], window.lo:hi].to("cpu", copy=True)

    # ------------------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """The graphs' counters (captures, replays, fallbacks); at the exact length: no graphs."""
        if self.graphs is not None:
            report = self.graphs.report()
            if len(self.row_sets) > 1:
                report["row_buckets"] = {rows: gs.report()["captured"] for rows, gs in self.row_sets.items()}
                report["captures"] = sum(gs.captures for gs in self.row_sets.values())
            return report
        return {"backend": self.backend_name, "exact_length": self.exact_length,
                "buckets": list(self.buckets), "captured": []}

    def describe(self) -> dict[str, Any]:
        """What was chosen at load: sizes, buckets, backend, buffer bytes, conv algorithms, the forms of
        the ops (``ops``: the `flashrt.ops.select` choices, and the conv policy's); the padding of
        the windows replayed so far and a warning for any padded by more than `PADDING_WARN`; the
        kernels one replay of the largest bucket launches on a GPU (`kernels.kernels_per_replay`)."""
        from flashrt.frontends.vocoders.kernels import kernels_per_replay

        if getattr(self, "_kernel_count", None) is None:
            self._kernel_count = kernels_per_replay(self).total
        sig = self.signature
        spectral = sum(1 for m in self.module.modules() if isinstance(m, SpectralPlan))
        split = sum(1 for m in self.module.modules() if getattr(m, "phase_split", False))
        native = sum(1 for m in self.module.modules()
                     if isinstance(m, Activation1d) and m.aa_snake.form == "native")
        winograd = sum(1 for m in self.module.modules() if getattr(m, "winograd", None) is not None)
        return {"family": self.family.name, "sample_rate": sig.sample_rate, "hop_length": sig.hop_length,
                "context": sig.context, "buckets": list(self.buckets), "backend": self.backend_name,
                "exact_length": self.exact_length, "batch": self.batch, "dtype": str(self.dtype),
                "buffer_bytes": self.buffers.nbytes() if self.buffers else 0, "spectral_convs": spectral,
                "spectral_bytes": spectral_bytes(self.module) if spectral else 0,
                "phase_split_convs": split, "winograd_convs": winograd, "native_activations": native,
                "notes": list(self.family.notes(self.config)), "padding": self.padding.as_dict(),
                "warnings": self.padding.warnings(), "kernels_per_replay": self._kernel_count,
                "ops": {**ops.choices(self.module), "conv1d": conv_forms(self.module)}}
