"""`load_vocoder` and `Vocoder`: a vocoder family's frontend behind the stream runner.

    import flashrt
    voc = flashrt.load_vocoder("path/to/checkpoint_dir")                 # family detected from config/keys
    voc = flashrt.load_vocoder("hifigan-v1", checkpoint="generator.pt")  # a model card (models/*.toml)
    audio = voc(mel)                                                     # (B, N) float32, on the host
    for piece in voc.stream(mel_chunks): ...                             # equals the one-shot output
    voc.report()                                                         # compute_ms, rtf, ttfa_ms

``load_vocoder(path_or_card, device="cpu", precision="fp32", backend=None, buckets=None, *, family=None,
config=None, checkpoint=None, stream_chunk=None, max_stream_chunk=None, batch=1, strict=False,
capture=True, exact_stream=False, conv=None, overrides=None, allow_download=False)``:

* path_or_card: a folder, a file, a model card, or a hub id (``"hubertsiuzdak/snac_24khz"``) read from
  the local Hugging Face cache (``allow_download=True`` lets `huggingface_hub` fetch it; it honours
  ``HF_HUB_OFFLINE``).
* family, config, checkpoint, precision (one vocabulary: "fp32" / "float32", "bf16" /
  "bfloat16", "fp16" / "float16" / "half", or a torch dtype), conv, overrides (config fields replaced
  after the config is picked): resolved by `flashrt.frontends.vocoders.load_vocoder_module` (its
  docstring says how).
* SNAC noise: the released SNAC decoders add random noise after each upsampler; flashrt's default
  (``noise_mode="off"``) drops it, so a decode is deterministic but not what the released decoder
  outputs. ``overrides={"noise_mode": "seeded", "noise_seed": 0}`` adds it, drawn from a hash of the
  seed and the sample position (reproducible, the same one-shot and streamed); `describe()` says which
  is on. CLI: ``--snac-noise seeded`` (`flashrt say`, `serve`, `bench snac`).
* backend: "eager" (CPU default: every call runs at its own length, see
  `flashrt.frontends.vocoders.frontend`), "trace", "cuda" (CUDA default), any registered graph backend,
  built for ``device`` (a frontend on cuda:1 captures on cuda:1).
* buckets: frame counts (the card's ``[runtime] buckets``, else the family's, as a geometric ladder on a
  graph backend: `flashrt.frontends.vocoders.frontend.ladder`); the stream windows ``L + chunk + R``
  are added. stream_chunk: frames of the first stream window (card, else family); max_stream_chunk
  (card, else ``stream_chunk``): the most a later window decodes, the windows growing as the stream
  goes (`flashrt.runner.stream.ChunkSchedule`: each as long as what was already emitted).
* exact_stream: one-shot calls decode through the stream's windows, so ``stream()`` equals them bit
  for bit (see `flashrt.runner.stream`: summation order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from flashrt.frontends.vocoders import load_vocoder_module
from flashrt.frontends.vocoders.base import VocoderFamily, VocoderSignature
from flashrt.frontends.vocoders.frontend import VocoderFrontend
from flashrt.runner.stream import ChunkSchedule, StreamRunner

__all__ = ["Vocoder", "load_vocoder"]


class Vocoder(StreamRunner):
    """A `VocoderFrontend` driven by the `StreamRunner`: ``voc(x)``, ``voc.stream(chunks)``, ``report()``,
    ``describe()``. The constructor builds the frontend (buckets plus the stream window) without
    capturing; `capture()` (which `load_vocoder` calls) allocates and captures."""

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
        max_stream_chunk: int | None = None,
        batch: int = 1,
        strict: bool = False,
        dtype: torch.dtype = torch.float32,
        exact_stream: bool = False,
        exact_length: bool | None = None,
        frontend: type[VocoderFrontend] = VocoderFrontend,
        stack_windows: bool = False,
    ) -> None:
        chunk = int(stream_chunk or family.default_stream_chunk)
        schedule = ChunkSchedule(chunk, chunk if max_stream_chunk is None else int(max_stream_chunk))
        context = sum(family.signature(config).context)
        windows = tuple(context + size for size in schedule.sizes())
        fe = frontend(family, config, module, device=device, backend=backend, batch=batch, strict=strict,
                      dtype=dtype, buckets=buckets, extra_buckets=windows, exact_length=exact_length,
                      stack_frames=windows[-1] if stack_windows else None)
        super().__init__(fe, chunk, max_chunk=schedule.limit, exact_stream=exact_stream)

    def capture(self) -> Vocoder:
        """Allocate the buffers and capture the graphs (load time, not the hot path)."""
        self.frontend.capture()
        return self

    # the frontend's state, read through (the public attributes of a loaded vocoder)
    family = property(lambda self: self.frontend.family)
    config = property(lambda self: self.frontend.config)
    module = property(lambda self: self.frontend.module)
    device = property(lambda self: self.frontend.device)
    dtype = property(lambda self: self.frontend.dtype)
    batch = property(lambda self: self.frontend.batch)
    backend_name = property(lambda self: self.frontend.backend_name)
    buckets = property(lambda self: self.frontend.buckets)
    max_frames = property(lambda self: self.frontend.max_frames)
    buffers = property(lambda self: self.frontend.buffers)
    graphs = property(lambda self: self.frontend.graphs)
    takes_offset = property(lambda self: self.frontend.takes_offset)

    @property
    def signature(self) -> VocoderSignature:
        return self.frontend.signature

    def buffer_specs(self) -> list:
        return self.frontend.buffer_specs()

    @property
    def sample_rate(self) -> int:
        """Audio samples per second of the output."""
        return int(self.frontend.describe()["sample_rate"])

    def describe(self) -> dict[str, Any]:
        """What was chosen at load, as a dict (as every family's `describe()`; `summary()` is the line)."""
        return {**self.frontend.describe(), "stream_chunk": self.stream_chunk,
                "max_stream_chunk": self.max_stream_chunk, "exact_stream": self.exact_stream}

    def _chunks(self) -> str:
        first, limit = self.stream_chunk, self.max_stream_chunk
        return str(first) if limit == first else f"{first} growing to {limit}"

    def summary(self) -> str:
        """`describe()` as one line for people."""
        d = self.frontend.describe()
        exact = ", one-shot through the stream windows" if self.exact_stream else ""
        length = " (each call at its own length)" if d["exact_length"] else ""
        convs = f", {d['spectral_convs']} spectral convs ({d['spectral_bytes']:,d} bytes)" \
            if d["spectral_convs"] else ""
        if d["phase_split_convs"]:
            convs += f", {d['phase_split_convs']} phase-split dilated convs (position-invariant)"
        if d.get("winograd_convs"):
            convs += f", {d['winograd_convs']} Winograd 3-tap convs"
        if d.get("native_activations"):
            convs += f", {d['native_activations']} anti-aliased activations in the native CPU kernel"
        notes = "".join(f"; {note}" for note in d["notes"])
        warnings = "".join(f"; WARNING: {w}" for w in d["warnings"])
        return (f"{d['family']} vocoder: {d['sample_rate']} Hz, hop {d['hop_length']}, context "
                f"{d['context']} frames, buckets {d['buckets']}, stream chunk {self._chunks()}"
                f"{exact}, backend {d['backend']}{length}, {d['buffer_bytes']:,d} buffer bytes{convs}, "
                f"{d['kernels_per_replay']:,d} kernels per replay{notes}{warnings}")


def load_vocoder(
    path_or_card: Any,
    device: str | torch.device = "cpu",
    precision: str | torch.dtype = "fp32",
    backend: str | None = None,
    buckets: Sequence[int] | None = None,
    *,
    family: str | None = None,
    config: Any = None,
    checkpoint: Any = None,
    stream_chunk: int | None = None,
    max_stream_chunk: int | None = None,
    batch: int = 1,
    stack_windows: bool = False,
    strict: bool = False,
    capture: bool = True,
    exact_stream: bool = False,
    conv: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    allow_download: bool = False,
) -> Vocoder:
    """Load, map strictly, and capture a vocoder (see the module docstring for every argument; SNAC's
    default drops the released decoders' noise: ``overrides={"noise_mode": "seeded"}`` keeps it).
    ``stack_windows`` (with ``batch`` > 1): the batch serves stream windows of several streams decoded
    together (`StreamRunner.decode_together`), so only one-row graphs cover the long one-shot buckets."""
    loaded = load_vocoder_module(path_or_card, device, precision, family=family, config=config,
                                 checkpoint=checkpoint, conv=conv, overrides=overrides,
                                 allow_download=allow_download)
    runtime = loaded.runtime
    voc = Vocoder(loaded.family, loaded.config, loaded.module, device=device, backend=backend,
                  dtype=loaded.dtype, batch=batch, strict=strict, buckets=buckets or runtime.get("buckets"),
                  stream_chunk=stream_chunk or runtime.get("stream_chunk"),
                  max_stream_chunk=max_stream_chunk or runtime.get("max_stream_chunk"),
                  exact_stream=exact_stream, stack_windows=stack_windows)
    return voc.capture() if capture else voc
