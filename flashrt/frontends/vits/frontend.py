"""VitsFrontend: a VITS voice as three sets of captured graphs over declared buffers.

Hot path of one utterance (phoneme ids in, audio out), every stage a replay of a captured bucket:

    p, checked = fe.check(ids, scales)               ids and scales validated, phoneme bucket p; NO buffer
                                                     touched
    fe.write(p, checked, seed)                       ids, mask, scales, duration noise (padded to p; noise=
                                                     a `Noise` gives the draws instead of the seed)
    fe.replay(p)                                     stage 1: encoder + duration predictor
    plan = fe.expand(checked, seed)                  HOST STEP: durations -> frames, frame bucket, index,
                                                     flow noise (the only device->host read in the middle)
    fe.flow(plan)                                    stage 2: prior expansion + flow (reverse)
    for window in plan.windows(...):                 decoder windows (one window = the one-shot run)
        audio = fe.decode(plan, window)              copy z's window, replay the decoder bucket, trim

Buffers (declared once; stage prefixes ``enc_``, ``flow_``, ``dec_``): every bucket's graph reads and
writes views ``[..., :bucket]`` of the max-size buffers. ``enc_m``/``enc_logs`` are state written by
stage 1 and read by stage 2; ``flow_z`` is written by stage 2 and copied window by window into
``dec_z``. Ownership: the frontend; valid until the next `write` (one utterance at a time, not
thread-safe: a runner serializes calls).

Streaming: the decoder's receptive field (`hifigan.receptive_field`) gives the context in frames; a
window decodes its chunk plus that much context on each side (clipped at the utterance's ends) and
keeps the chunk's samples, so the concatenated chunks equal the one-shot decode (to float rounding of
the conv algorithms, measured <= 1e-6). The first window does not wait for the flow of the whole
utterance: `flow(plan, upto)` runs the flow over a prefix reaching its receptive field past the window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from flashrt import ops
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.vits.config import VitsConfig
from flashrt.frontends.vits.model import VitsPrior, frame_index
from flashrt.frontends.vits.modules import relative_index
from flashrt.frontends.vocoders.hifigan import HifiGan, receptive_field
from flashrt.nn.audio import ValidLength
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import GraphSet, backend_for_device

# The decoder's backend where it is not the prior's: under `jit` the prior's small ops replay in TorchScript
# (no Python per op, the GIL released; the same ops, bit for bit) while the decoder stays eager: its
# stages run in reused buffers and cache-sized tiles only in plain eager calls (`VitsDecoder`), which is
# worth more than the interpreter at its few large convs.
DECODE_BACKEND = {"jit": "eager"}

__all__ = [
    "VitsFrontend",
    "Checked",
    "Plan",
    "Window",
    "Noise",
    "SeededNoise",
    "RecordedNoise",
    "PHONEME_BUCKETS",
    "FRAME_BUCKETS",
    "DECODE_BACKEND",
]


def ladder(*spans: tuple[int, int]) -> tuple[int, ...]:
    """Buckets from (step, stop) spans: ladder((32, 512), (128, 1024)) = 32, 64, ..., 512, 640, ..., 1024.
    Fine steps keep the padding waste of short inputs small (a padded frame costs as much as a real one)."""
    out, start = [], 0
    for step, stop in spans:
        out += range(start + step, stop + 1, step)
        start = stop
    return tuple(out)


# Above 128 every step is at most 1/8 of the bucket below it, so no input pads more than 12.5 % (the old
# (128, 2048) span padded a 513-frame sentence to 640: 25 % more flow and decoder work, ~10 % of a
# paragraph's synthesis on the CPU). Steps double with the length: 8-9 buckets per octave. Up to 128 the
# step is 8 (a 69-frame "Hello there." ran at 80 frames with 16): each bucket's oneDNN plans are made
# once, on its first call (the decoder's tiled last stage has two shapes for every bucket, decoder.py).
PHONEME_BUCKETS = ladder((8, 128), (16, 256), (32, 512), (64, 1024))
FRAME_BUCKETS = ladder((8, 128), (16, 256), (32, 512), (64, 1024), (128, 2048), (256, 4096), (512, 6144))


class Noise(Protocol):
    """Where an utterance's standard-normal draws come from: ``duration`` (2, P) for the stochastic
    duration predictor (scaled by noise_w inside stage 1), ``prior`` (C, F) for sampling the prior
    (scaled by noise_scale and exp(logs) inside stage 2). Drawn on the host over the real phonemes and
    frames only, so they do not depend on buckets."""

    def duration(self, phonemes: int) -> torch.Tensor: ...

    def prior(self, channels: int, frames: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class SeededNoise:
    """Draws from ``seed`` (one generator per stream: same seed, same noise) or, with None, from torch's
    global generator."""

    seed: int | None = None

    def _generator(self, stream: int) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator().manual_seed(int(self.seed) * 2 + stream)

    def duration(self, phonemes: int) -> torch.Tensor:
        return torch.randn(2, phonemes, generator=self._generator(0))

    def prior(self, channels: int, frames: int) -> torch.Tensor:
        return torch.randn(channels, frames, generator=self._generator(1))


@dataclass(frozen=True)
class RecordedNoise:
    """Given draws, e.g. a reference runtime's (onnxruntime's RandomNormalLike outputs): ``durations``
    (2, P) and ``prior`` (C, F) for exactly one utterance; a shape that does not fit is an InputError."""

    durations: torch.Tensor
    latent: torch.Tensor

    def duration(self, phonemes: int) -> torch.Tensor:
        return _fitting(self.durations, (2, phonemes), "duration noise")

    def prior(self, channels: int, frames: int) -> torch.Tensor:
        return _fitting(self.latent, (channels, frames), "prior noise")


def _fitting(draws: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    t = torch.as_tensor(draws)
    if tuple(t.shape) != shape:
        raise InputError(f"{what}: expected shape {shape} for this utterance, got {tuple(t.shape)}")
    return t


@dataclass(frozen=True)
class Checked:
    """Validated inputs of one utterance (host values; nothing written yet)."""

    ids: torch.Tensor  # (P,) int64
    scales: torch.Tensor  # (3,) float32: noise_scale, length_scale, noise_w
    speaker: int = 0  # speaker id (multi-speaker voices)

    @property
    def phonemes(self) -> int:
        return int(self.ids.numel())


@dataclass(frozen=True)
class Window:
    """Decode frames [start, stop) and keep the samples of frames [keep_start, keep_stop)."""

    start: int
    stop: int
    keep_start: int
    keep_stop: int


@dataclass(frozen=True)
class Plan:
    """What the host step decided: the real frame count, its bucket, and the durations (P,)."""

    frames: int
    bucket: int
    durations: np.ndarray

    def windows(self, first: int, chunk: int, context: tuple[int, int]) -> Iterator[Window]:
        """Chunks of `first` then `chunk` frames, each with `context` (left, right) frames around it."""
        left, right = context
        start, size = 0, first
        while start < self.frames:
            stop = min(start + size, self.frames)
            yield Window(max(0, start - left), min(self.frames, stop + right), start, stop)
            start, size = stop, chunk


@dataclass(frozen=True)
class FlowInputs:
    """What the flow reads for one planned sentence: buffer name -> (copy, the slice it came from)."""

    parts: dict[str, tuple[torch.Tensor, tuple[slice, ...]]]


def _extent(view: torch.Tensor) -> tuple[slice, ...]:
    """The slice of its base buffer a leading-slice view covers (every view above starts at 0)."""
    return tuple(slice(0, size) for size in view.shape)


class VitsFrontend:
    """A loaded VITS voice: buffers, three graph sets, the verbs of the module docstring."""

    def __init__(
        self,
        cfg: VitsConfig,
        prior: VitsPrior,
        decoder: HifiGan,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str | None = None,
        phoneme_buckets: Sequence[int] = PHONEME_BUCKETS,
        frame_buckets: Sequence[int] = FRAME_BUCKETS,
        window_buckets: Sequence[int] = (),
    ) -> None:
        self.cfg, self.prior, self.decoder = cfg, prior, decoder
        self.device, self.dtype = torch.device(device), dtype
        self.phoneme_buckets = tuple(sorted(set(int(b) for b in phoneme_buckets)))
        self.frame_buckets = tuple(sorted(set(int(b) for b in frame_buckets)))
        self.decode_buckets = tuple(sorted(set(self.frame_buckets) | {int(b) for b in window_buckets}))
        if max(self.decode_buckets) > max(self.frame_buckets):
            raise ConfigError(f"vits: window buckets {window_buckets} exceed the largest frame bucket")
        left, right = receptive_field(cfg.decoder).frames()
        self.context = (left + 1, right + 1)
        layers = sum(cfg.flow_dilation_rate**i for i in range(cfg.flow_layers))
        self.flow_reach = cfg.flow_flows * layers * (cfg.flow_kernel_size - 1) // 2 + 1
        self.buffers = Buffers(self._specs(), self.device)
        if cfg.n_speakers > 1:
            self._base_bias = decoder.conv_pre.bias.detach().clone()
        self._backend = backend_for_device(backend, self.device)
        decode_backend = DECODE_BACKEND.get(self._backend.name, backend)
        self._decode_backend = backend_for_device(decode_backend, self.device)
        self.encode_graphs = GraphSet(
            self._backend,
            self._build_encode,
            self.phoneme_buckets,
            buffers=self.buffers,
            max_graphs=max(16, len(self.phoneme_buckets)),
        )
        self.flow_graphs = GraphSet(
            self._backend,
            self._build_flow,
            self.frame_buckets,
            buffers=self.buffers,
            max_graphs=max(16, len(self.frame_buckets)),
        )
        self.decode_graphs = GraphSet(
            self._decode_backend,
            self._build_decode,
            self.decode_buckets,
            buffers=self.buffers,
            max_graphs=max(16, len(self.decode_buckets)),
        )

    # ----------------------------------------------------------------------------------- buffers

    def _specs(self) -> list[BufferSpec]:
        p, f, d = max(self.phoneme_buckets), max(self.frame_buckets), max(self.decode_buckets)
        c, dt, hop = self.cfg.inter_channels, self.dtype, self.cfg.hop_length
        return [
            BufferSpec("enc_ids", (1, p), torch.int64, low=0, high=self.cfg.n_vocab - 1, doc="phoneme ids"),
            BufferSpec("enc_mask", (1, 1, p), dt, doc="1 on real phonemes"),
            BufferSpec("enc_noise", (1, 2, p), dt, doc="duration-predictor noise (scaled by noise_w inside)"),
            BufferSpec("scales", (3,), dt, doc="noise_scale, length_scale, noise_w"),
            BufferSpec("enc_m", (1, c, p), dt, "state", doc="prior mean per phoneme (stage 1 -> 2)"),
            BufferSpec("enc_logs", (1, c, p), dt, "state", doc="prior log-std per phoneme (stage 1 -> 2)"),
            BufferSpec("enc_durations", (1, p), dt, "output", doc="ceil durations in frames"),
            BufferSpec("flow_index", (f,), torch.int64, low=0, high=p - 1, doc="phoneme of each frame"),
            BufferSpec("flow_mask", (1, 1, f), dt, doc="1 on real frames"),
            BufferSpec("flow_noise", (1, c, f), dt, doc="prior noise (scaled by noise_scale inside)"),
            BufferSpec("flow_z", (1, c, f), dt, "output", doc="decoder input of the whole utterance"),
            BufferSpec("dec_z", (1, c, d), dt, doc="the decoder window"),
            BufferSpec("dec_length", (1,), torch.int64, low=1, high=d, doc="real frames of the window"),
            BufferSpec("dec_audio", (1, d * hop), dt, "output", doc="window audio"),
            BufferSpec(
                "speaker",
                (1, max(self.cfg.gin_channels, 1), 1),
                dt,
                doc="speaker vector g (multi-speaker voices; read by stages 1 and 2)",
            ),
        ]

    # ---------------------------------------------------------------------------------- captures

    def _build_encode(self, p: int):
        b, index = self.buffers, relative_index(p, self.cfg.window_size, self.device)
        ids, mask, noise = b["enc_ids"][:, :p], b["enc_mask"][..., :p], b["enc_noise"][..., :p]
        m_out, logs_out, w_out = b["enc_m"][..., :p], b["enc_logs"][..., :p], b["enc_durations"][:, :p]

        g = b["speaker"] if self.cfg.n_speakers > 1 else None

        def step() -> None:
            m, logs, w = self.prior.encode(ids, mask, noise, b["scales"], index, g)
            m_out.copy_(m)
            logs_out.copy_(logs)
            w_out.copy_(w)

        return step

    def _build_flow(self, f: int):
        b = self.buffers
        index, mask, noise, z_out = (
            b["flow_index"][:f],
            b["flow_mask"][..., :f],
            b["flow_noise"][..., :f],
            b["flow_z"][..., :f],
        )

        g = b["speaker"] if self.cfg.n_speakers > 1 else None

        def step() -> None:
            m = b["enc_m"].index_select(2, index)
            logs = b["enc_logs"].index_select(2, index)
            z_out.copy_(self.prior.latent(m, logs, noise, b["scales"], mask, g))

        return step

    def _build_decode(self, d: int):
        b, hop = self.buffers, self.cfg.hop_length
        z, out = b["dec_z"][..., :d], b["dec_audio"][:, : d * hop]

        dec_dtype = next(self.decoder.parameters()).dtype  # bfloat16 beside a float32 prior, or the same

        def step() -> None:
            out.copy_(self.decoder(z.to(dec_dtype), ValidLength(b["dec_length"], d)))

        return step

    def capture(self) -> VitsFrontend:
        """Capture every declared bucket now (load time) instead of on first use."""
        for graphs in (self.encode_graphs, self.flow_graphs, self.decode_graphs):
            graphs.capture_all()
        return self

    # ------------------------------------------------------------------------------------- verbs

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.phoneme_buckets

    def check(
        self,
        ids: Any,
        noise_scale: float = 0.667,
        length_scale: float = 1.0,
        noise_w: float = 0.8,
        speaker: int = 0,
    ) -> tuple[int, Checked]:
        """Validate phoneme ids (1-D ints in the vocabulary, 1..max bucket long) and the three scales;
        (phoneme bucket, checked). Nothing is written."""
        t = torch.as_tensor(np.asarray(ids))
        if t.ndim != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InputError(
                f"ids: expected a non-empty 1-D sequence of ints, got {tuple(t.shape)} {t.dtype}"
            )
        if t.numel() > self.phoneme_buckets[-1]:
            raise InputError(
                f"ids: {t.numel()} phonemes exceed the largest bucket {self.phoneme_buckets[-1]}; "
                "split the text into shorter sentences"
            )
        if int(t.min()) < 0 or int(t.max()) >= self.cfg.n_vocab:
            raise InputError(
                f"ids: values must lie in [0, {self.cfg.n_vocab}), got [{int(t.min())}, {int(t.max())}]"
            )
        scales = (float(noise_scale), float(length_scale), float(noise_w))
        if not all(np.isfinite(scales)) or scales[0] < 0 or scales[2] < 0 or not 0.05 <= scales[1] <= 20:
            raise InputError(
                f"scales: noise_scale >= 0, 0.05 <= length_scale <= 20, noise_w >= 0; got {scales}"
            )
        if (
            isinstance(speaker, bool)
            or not isinstance(speaker, (int, np.integer))
            or not 0 <= int(speaker) < self.cfg.n_speakers
        ):
            raise InputError(f"speaker: expected an int in [0, {self.cfg.n_speakers}), got {speaker!r}")
        bucket = self.encode_graphs.select(t.numel())
        return bucket, Checked(t.to(torch.int64), torch.tensor(scales, dtype=torch.float32), int(speaker))

    def write(
        self, bucket: int, checked: Checked, seed: int | None = None, *, noise: Noise | None = None
    ) -> None:
        """Stage-1 inputs (padded to the phoneme bucket). The duration noise comes from ``noise`` (a
        `Noise`), by default `SeededNoise(seed)` (same seed, same noise), over the real phonemes only."""
        n = checked.phonemes
        b = self.buffers
        b["enc_ids"].zero_()
        b["enc_ids"][0, :n].copy_(checked.ids)
        b["enc_mask"].zero_()
        b["enc_mask"][..., :n] = 1
        b["scales"].copy_(checked.scales)
        b["enc_noise"].zero_()
        if checked.scales[2] > 0:
            b["enc_noise"][0, :, :n].copy_((SeededNoise(seed) if noise is None else noise).duration(n))
        self.use_speaker(checked.speaker)

    def use_speaker(self, sid: int) -> None:
        """Make `sid` the speaker the next flow and decoder windows condition on (multi-speaker voices;
        others have one). A sentence interleaved with other requests' sets its own again before each
        of its steps."""
        if self.cfg.n_speakers > 1:
            self._write_speaker(sid)

    def _write_speaker(self, sid: int) -> None:
        """g into the speaker buffer; the decoder's conditioning folded into its conv_pre bias (written in
        place: captured graphs read the same storage). `_base_bias` keeps the checkpoint's bias."""
        with torch.no_grad():
            g = self.prior.speaker(sid)
            self.buffers["speaker"].copy_(g)
            self.decoder.conv_pre.bias.copy_(self._base_bias + self.prior.speaker_bias(g))

    def replay(self, bucket: int) -> None:
        self.encode_graphs.replay(bucket)

    def expand(self, checked: Checked, seed: int | None = None, *, noise: Noise | None = None) -> Plan:
        """The host step: read the durations, lay out the frames, write stage 2's inputs (the prior noise
        from ``noise``, by default `SeededNoise(seed)`)."""
        n = checked.phonemes
        durations = self.buffers["enc_durations"][0, :n].to("cpu", torch.float64).numpy()
        index = frame_index(durations)
        frames = index.size
        if frames > self.frame_buckets[-1]:
            raise InputError(
                f"{frames} frames exceed the largest frame bucket {self.frame_buckets[-1]}; "
                "split the text into shorter sentences or lower length_scale"
            )
        bucket = self.flow_graphs.bucket_for(frames)
        b = self.buffers
        b["flow_index"][:bucket].zero_()  # the graph reads [:bucket] only
        b["flow_index"][:frames].copy_(torch.from_numpy(index))
        b["flow_noise"][..., :bucket].zero_()
        if checked.scales[0] > 0:
            draws = (SeededNoise(seed) if noise is None else noise).prior(self.cfg.inter_channels, frames)
            b["flow_noise"][0, :, :frames].copy_(draws)
        return Plan(frames, bucket, durations.astype(np.int64))

    def flow(self, plan: Plan, upto: int | None = None) -> int:
        """Stage 2 over every frame, or (``upto``) over just enough frames for z on [0, upto) to be exact:
        the flow's receptive field (`flow_reach`) past it. Streams run the prefix first so the first
        window decodes before the whole utterance went through the flow. Returns the frames computed."""
        frames = plan.frames if upto is None else min(plan.frames, int(upto) + self.flow_reach)
        bucket = plan.bucket if frames == plan.frames else self.flow_graphs.bucket_for(frames)
        mask = self.buffers["flow_mask"]
        mask.zero_()
        mask[..., :frames] = 1
        self.flow_graphs.replay(bucket)
        return frames

    def decode(self, window: Window, z: torch.Tensor | None = None) -> torch.Tensor:
        """Audio (N,) of the window's kept frames, float32 on the host; the frames come from the flow's
        output, or from `z` (a sentence's `latent`, kept while other sentences used the buffers)."""
        size, hop = window.stop - window.start, self.cfg.hop_length
        bucket = self.decode_graphs.bucket_for(size)
        b = self.buffers
        source = b["flow_z"] if z is None else z
        b["dec_z"][..., :size].copy_(source[..., window.start : window.stop])
        b["dec_length"].fill_(size)
        self.decode_graphs.replay(bucket)
        lo, hi = (window.keep_start - window.start) * hop, (window.keep_stop - window.start) * hop
        return b["dec_audio"][0, lo:hi].to("cpu", torch.float32, copy=True)

    def latent(self, plan: Plan) -> torch.Tensor:
        """A copy of the flow's output z over the plan's frames (after `flow` over all of them)."""
        return self.buffers["flow_z"][..., : plan.frames].clone()

    def flow_inputs(self, plan: Plan) -> FlowInputs:
        """Copies of what the flow reads for this plan (after `expand`), so other sentences may use the
        buffers before this one's flow runs; `restore_flow_inputs` puts them back (the speaker is set
        apart, `use_speaker`: the decoder reads it too)."""
        b, n = self.buffers, int(plan.durations.size)
        parts = {
            "enc_m": b["enc_m"][..., :n],
            "enc_logs": b["enc_logs"][..., :n],
            "flow_index": b["flow_index"][: plan.bucket],
            "flow_noise": b["flow_noise"][..., : plan.bucket],
            "scales": b["scales"],
        }
        return FlowInputs({name: (view.clone(), _extent(view)) for name, view in parts.items()})

    def restore_flow_inputs(self, saved: FlowInputs) -> None:
        for name, (value, extent) in saved.parts.items():
            self.buffers[name][extent].copy_(value)

    def read(self, plan: Plan) -> torch.Tensor:
        """The one-shot audio of the planned utterance: one window holding every frame."""
        return self.decode(Window(0, plan.frames, 0, plan.frames))

    # ----------------------------------------------------------------------------------- helpers

    def describe(self) -> dict[str, Any]:
        from flashrt.nn.conv_policy import conv_forms

        return {
            "family": "vits",
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "decoder_dtype": str(next(self.decoder.parameters()).dtype).removeprefix("torch."),
            "backend": self._backend.name,
            "decode_backend": self._decode_backend.name,
            "phoneme_buckets": list(self.phoneme_buckets),
            "frame_buckets": list(self.frame_buckets),
            "decode_buckets": list(self.decode_buckets),
            "context_frames": list(self.context),
            "hop_length": self.cfg.hop_length,
            "sample_rate": self.cfg.sample_rate,
            "buffer_bytes": self.buffers.nbytes(),
            "ops": {**ops.choices(self.prior), **ops.choices(self.decoder),
                    "conv1d": conv_forms(self.decoder)},
        }

    def report(self) -> dict[str, Any]:
        return {
            "encode": self.encode_graphs.report(),
            "flow": self.flow_graphs.report(),
            "decode": self.decode_graphs.report(),
        }
