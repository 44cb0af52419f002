"""`hifigan`, `bigvgan`, `vocos`, `snac` benchmarks: one utterance decoded in one call (batch 1).

One call = the vocoder's one-shot decode of T frames (mel features, or SNAC's codes of every scale) into
(1, N) float32 audio. Timed stages (`flashrt.bench.registry.STAGES` names):

    validate     layout, dtype, range and finiteness of the inputs; the size against the buckets
    h2d          the bucket picked, inputs padded to it and copied into the static buffers
    replay       the captured decode of that bucket
    d2h          the audio copied back to the host

(`Vocoder.__call__(*inputs, timer=timer)` itself times these stages.)

Sizes (`profile.shapes.preset` -> the family's preset, `SPECS`): `tiny` -> each family's "tiny";
`small` -> the realistic sizes: HiFi-GAN V1 (22.05 kHz), BigVGAN-base (24 kHz, 100 bands), Vocos mel
24 kHz, SNAC 24 kHz (noise blocks off); `full` / `expert` -> the largest released sizes (BigVGAN v2
24 kHz 256x, the others as `small`). Frames per call: `shapes.chunk`, else as many as make
`TARGET_SAMPLES[preset]` samples (about 2.1-2.3 s of audio for the realistic sizes); buckets:
`shapes.buckets`, else that one length. `[model]` takes `seed`, and for SNAC `noise_mode` (`bench snac
--snac-noise seeded`): the decoder with its noise blocks, drawn position-seeded; the snac package then is
no reference (it draws unseeded noise) and the random weights are flashrt's own.

Weights, RANDOM and seeded (latency does not depend on their values):

* where the family's reference package imports (the reference venv), the package builds its own model
  at these sizes, randomized (bench/vocoders.py's `randomize_`), and saves it in its release layout;
  flashrt loads that folder with `load_vocoder`, exactly like a downloaded checkpoint, and the package
  reference loads the same folder: same weights on both sides;
* elsewhere, flashrt's module is filled directly with seeded random tensors (its own layout), and the
  package reference is unavailable;
* with `--checkpoint DIR` (a real or saved checkpoint) both load DIR.

References (`--vs`, `quality.reference`): eager (the same module behind the eager backend, own static
buffers), trace / cuda / eager-backend (that graph backend), compile (each bucket's decode under
torch.compile), and the family's package: transformers (`SpeechT5HifiGan`), bigvgan (`BigVGAN` after
`remove_weight_norm()`), vocos (`Vocos.decode`), snac (`SNAC.decode`).

FLOPs per call are counted by running the module once under `torch.utils.flop_counter.FlopCounterMode`
(convolutions, transposed convolutions, matmuls, and the oneDNN fused conv / linear kernels of the CPU
path: 2 per multiply-add; element-wise work and FFTs are not counted); bytes = weights + inputs + audio
(activations not counted).

Shape letters: T frames per call, C mel bins, N samples = T * hop - trim.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.frontends.vocoders import checkpoint_config, get_family, prepare_module
from flashrt.frontends.vocoders.frontend import VocoderFrontend
from flashrt.profile.timers import StageTimer
from flashrt.quant.precision import compute_dtype
from flashrt.runner.vocoder import Vocoder, load_vocoder
from flashrt.testing.synthetic.vocoders import WRITERS, random_module

TARGET_SAMPLES = {"tiny": 2048, "small": 51_200, "full": 51_200, "expert": 51_200}
SWEEP_FRAMES = {"mel": (50, 83, 128, 200, 256, 300, 333, 400, 512, 640, 800, 1000),
                "snac": (6, 10, 16, 24, 32, 38, 41, 50, 64, 80, 100, 125)}
_MODEL_KEYS = ("seed", "noise_mode")


# ------------------------------------------------------------------------------------------ packages
def _quiet(fn: Callable[[], Any]) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


def _load_speecht5(folder: Path, cfg: Any, device: str) -> Callable[..., torch.Tensor]:
    from transformers import SpeechT5HifiGan

    ref = SpeechT5HifiGan.from_pretrained(str(folder)).to(device).eval()
    return lambda mel: ref(mel.transpose(1, 2))


def _load_bigvgan(folder: Path, cfg: Any, device: str) -> Callable[..., torch.Tensor]:
    from bigvgan.bigvgan import BigVGAN
    from bigvgan.env import AttrDict

    ref = BigVGAN(AttrDict(json.loads((folder / "config.json").read_text())), use_cuda_kernel=False)
    state = torch.load(folder / "bigvgan_generator.pt", map_location="cpu", weights_only=True)
    ref.load_state_dict(state["generator"])
    _quiet(ref.remove_weight_norm)  # as its inference scripts do
    ref = ref.to(device).eval()
    return lambda mel: ref(mel)


def _load_vocos(folder: Path, cfg: Any, device: str) -> Callable[..., torch.Tensor]:
    from vocos import Vocos

    ref = Vocos.from_hparams(str(folder / "config.yaml"))
    ref.load_state_dict(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True),
                        strict=False)
    ref = ref.to(device).eval()
    return lambda mel: ref.decode(mel)


def _load_snac(folder: Path, cfg: Any, device: str) -> Callable[..., torch.Tensor]:
    from snac import SNAC

    ref = SNAC(**json.loads((folder / "config.json").read_text()))
    ref.load_state_dict(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True))
    ref = ref.to(device).eval()
    return lambda *codes: ref.decode(list(codes))


# ------------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class FamilySpec:
    """How one family is benchmarked: family presets per profile preset, config overrides, and its
    reference package (`write`: build, randomize, save in the package's layout; `load`: that folder ->
    a callable taking the vocoder's inputs and returning audio)."""

    family: str
    presets: Mapping[str, str]
    package: str
    write: Callable[[Any, Path, int], None]
    load: Callable[[Path, Any, str], Callable[..., torch.Tensor]]
    overrides: Mapping[str, Any] = field(default_factory=dict)


def _presets(tiny: str, realistic: str, largest: str | None = None) -> dict[str, str]:
    return {"tiny": tiny, "small": realistic, "full": largest or realistic, "expert": largest or realistic}


SPECS: dict[str, FamilySpec] = {
    "hifigan": FamilySpec("hifigan", _presets("tiny", "v1"), "transformers", WRITERS["hifigan"],
                          _load_speecht5),
    "bigvgan": FamilySpec("bigvgan", _presets("tiny", "base-24k-100band", "v2-24k-100band-256x"), "bigvgan",
                          WRITERS["bigvgan"], _load_bigvgan),
    "vocos": FamilySpec("vocos", _presets("tiny", "mel-24khz"), "vocos", WRITERS["vocos"], _load_vocos),
    "snac": FamilySpec("snac", _presets("tiny", "24khz"), "snac", WRITERS["snac"], _load_snac,
                       overrides={"noise": False}),
}


def bench_config(spec: FamilySpec, profile: Profile) -> Any:
    """The family config the profile's preset names (with the spec's overrides)."""
    where = profile.path or profile.name
    if profile.shapes.preset not in spec.presets:
        raise ConfigError(f"{where}: {spec.family} has no preset {profile.shapes.preset!r}; "
                          f"presets: {sorted(spec.presets)}")
    cfg = get_family(spec.family).presets[spec.presets[profile.shapes.preset]]
    fields = {f for f in spec.overrides if hasattr(cfg, f)}
    return replace(cfg, **{f: spec.overrides[f] for f in fields})


def _noise_overrides(spec: FamilySpec, profile: Profile) -> dict[str, Any]:
    """SNAC's `[model] noise_mode` as config overrides: {} for "off" (the default)."""
    mode = profile.model.get("noise_mode", "off")
    where = profile.path or profile.name
    if "noise_mode" in profile.model and spec.family != "snac":
        raise ConfigError(f"{where}: [model] noise_mode (--snac-noise) is a SNAC option, not {spec.family}'s")
    if mode not in ("off", "seeded"):
        raise ConfigError(f"{where}: [model] noise_mode {mode!r}; choose 'off' or 'seeded'")
    return {"noise_mode": "seeded"} if mode == "seeded" else {}


# ------------------------------------------------------------------------------------------ building
def count_flops(module: torch.nn.Module, inputs: list[torch.Tensor]) -> float:
    """Matmul and convolution FLOPs (2 per multiply-add) of one `module(*inputs)` call, counted by
    FlopCounterMode, which is taught the oneDNN fused kernels the CPU path runs (`MKLDNN_FLOPS`)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=MKLDNN_FLOPS) as counter, torch.no_grad():
        module(*inputs)
    return float(counter.get_total_flops())


def _mkldnn_conv(*args: Any, out_shape: Any = None, **_: Any) -> int:
    """mkldnn::_convolution_pointwise (X, W, ...), its .binary (X, other, W, ...) or the in-place
    _convolution_pointwise_.binary (other, X, W, ...): every output element takes (in / groups) x kernel
    multiply-adds."""
    weight = args[2] if len(args) > 10 else args[1]
    return 2 * math.prod(out_shape) * math.prod(weight[1:])


def _mkldnn_linear(*args: Any, out_shape: Any = None, **_: Any) -> int:
    """mkldnn::_linear_pointwise (X, W, ...) or .binary (X, other, W, B, attr); W is (out, in)."""
    weight = args[2] if len(args) == 5 else args[1]
    return 2 * math.prod(out_shape) * weight[1]


MKLDNN_FLOPS: dict[Any, Callable[..., int]] = {}
for _op, _formula in (("_convolution_pointwise", _mkldnn_conv), ("_convolution_pointwise_", _mkldnn_conv),
                      ("_linear_pointwise", _mkldnn_linear)):
    if hasattr(torch.ops.mkldnn, _op):
        MKLDNN_FLOPS[getattr(torch.ops.mkldnn, _op)] = _formula


def frames_per_call(profile: Profile, hop_length: int) -> int:
    """`shapes.chunk`, else the frames of about TARGET_SAMPLES[preset] samples."""
    return profile.shapes.chunk or math.ceil(TARGET_SAMPLES[profile.shapes.preset] / hop_length)


# ------------------------------------------------------------------------------------------ hot path
def staged_decode(voc: Vocoder, inputs: Mapping[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
    """The vocoder's one-shot decode, its stages (validate, h2d, replay, d2h; module doc) into `timer`."""
    return {"audio": voc(*[inputs[s.name] for s in voc.signature.inputs], timer=timer)}


class VocoderRunner:
    """One implementation: a captured `Vocoder` run through `staged_decode`."""

    def __init__(self, name: str, voc: Vocoder):
        self.name, self.voc = name, voc

    def run(self, inputs: Mapping[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        return staged_decode(self.voc, inputs, timer)


class CompiledFrontend(VocoderFrontend):
    """A `VocoderFrontend` whose per-bucket decode runs under torch.compile (each variant compiled on first
    use); bucketed, so each bucket compiles once (at the exact length every new length would recompile)."""

    def _bucket_fn(self, frames: int, exact: bool) -> Callable[[], None]:
        return torch.compile(super()._bucket_fn(frames, exact), dynamic=False)


def sibling(voc: Vocoder, backend: str, frontend: type = VocoderFrontend, **options: Any) -> Vocoder:
    """A second captured vocoder over the SAME module (weights): own buffers and graphs on `backend`."""
    return Vocoder(voc.family, voc.config, voc.module, device=voc.device, backend=backend,
                   buckets=voc.buckets, stream_chunk=voc.stream_chunk, batch=voc.batch, dtype=voc.dtype,
                   frontend=frontend, **options).capture()


class PackageRunner:
    """The reference package's model (loaded from the same folder): inputs to its device, its decode,
    audio back as (B, N) float32."""

    def __init__(self, name: str, decode: Callable[..., torch.Tensor], voc: Vocoder):
        self.name, self.decode, self.voc = name, decode, voc

    def run(self, inputs: Mapping[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        names = [s.name for s in self.voc.signature.inputs]
        with timer.stage("h2d"):
            values = [torch.as_tensor(inputs[n]).to(self.voc.device) for n in names]
        with timer.stage("forward"), torch.inference_mode():
            audio = self.decode(*values)
        with timer.stage("d2h"):
            return {"audio": audio.reshape(values[0].shape[0], -1).float().cpu()}


# ------------------------------------------------------------------------------------------ the adapter
def _dtype(profile: Profile) -> str:
    compute_dtype(profile.precision)       # ConfigError naming the supported precisions
    return profile.precision


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class VocoderBenchmark:
    """Adapter of the `Benchmark` protocol (flashrt.bench.registry) for one vocoder family."""

    def __init__(self, spec: FamilySpec, profile: Profile, checkpoint: str | None, device: str):
        unknown = sorted(set(profile.model) - set(_MODEL_KEYS))
        if unknown:
            raise ConfigError(f"{profile.path or profile.name}: [model] keys {unknown} are not vocoder "
                              f"benchmark options {list(_MODEL_KEYS)}")
        self.spec, self.profile, self.device = spec, profile, device
        self.precision, self.seed = _dtype(profile), int(profile.model.get("seed", 0))
        self.noise = _noise_overrides(spec, profile)
        self.cold_start_ms: dict[str, float] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.package_error = ""
        self.folder = Path(checkpoint) if checkpoint else self._write_with_package()
        self.voc = self._load()
        self.frames = frames_per_call(profile, self.voc.signature.hop_length)
        self.impl = VocoderRunner(f"flashrt:{self.voc.backend_name}", self.voc)
        self.name = self.impl.name
        self._flops: float | None = None

    # -------------------------------------------------------------------------------- setup
    def _write_with_package(self) -> Path | None:
        """The random checkpoint in the package's release layout, or None where the package is missing."""
        if self.noise:
            self.package_error = f"the {self.spec.package} package draws unseeded noise (--snac-noise seeded)"
            return None
        cfg, start = bench_config(self.spec, self.profile), time.perf_counter()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"flashrt-bench-{self.spec.family}-")
        folder = Path(self._tmp.name) / self.spec.family
        try:
            _quiet(lambda: self.spec.write(cfg, folder, self.seed))
        except (ImportError, ConfigError) as exc:
            self.package_error = f"{type(exc).__name__}: {exc}"
            return None
        self.cold_start_ms["write_checkpoint"] = _ms_since(start)
        return folder

    def _load(self) -> Vocoder:
        start, dtype = time.perf_counter(), compute_dtype(self.precision)
        family = get_family(self.spec.family)
        if self.folder is None:
            cfg = bench_config(self.spec, self.profile)
            cfg = replace(cfg, noise=True, **self.noise) if self.noise else cfg   # with its noise blocks
            module = prepare_module(family, random_module(family, cfg, self.seed, self.device, dtype),
                                    self.device, dtype)                  # the family's conv policy, as loaded
        else:
            loaded = load_vocoder(self.folder, self.device, self.precision, family=self.spec.family,
                                  config=self._folder_config(family), capture=False, overrides=self.noise)
            cfg, module = loaded.config, loaded.module
        frames = frames_per_call(self.profile, family.signature(cfg).hop_length)
        voc = Vocoder(family, cfg, module, device=self.device, backend=self.profile.runtime.backend,
                      dtype=dtype, buckets=tuple(self.profile.shapes.buckets) or (frames,))
        self.cold_start_ms["load"] = _ms_since(start)
        start = time.perf_counter()
        voc.capture()
        self.cold_start_ms["capture"] = _ms_since(start)
        return voc

    def _folder_config(self, family: Any) -> Any:
        """None where the checkpoint carries its config (config.json, or Vocos' config.yaml: load_vocoder
        reads it); bare weights take the profile's preset."""
        return None if checkpoint_config(self.folder) is not None else bench_config(self.spec, self.profile)

    # -------------------------------------------------------------------------------- protocol
    def make_inputs(self, trace_seed: int) -> list[dict[str, torch.Tensor]]:
        """Per input of the signature: features N(0, 1) (1, C, T*rate) float32, or codes uniform in the
        codebook (1, T*rate) int64."""
        g = torch.Generator().manual_seed(trace_seed)
        return [self._draw(self.frames, g) for _ in range(self.profile.bench.trace_len)]

    def _draw(self, frames: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        item = {}
        for s in self.voc.signature.inputs:
            steps = frames * s.rate
            item[s.name] = (torch.randint(0, s.high + 1, (1, steps), generator=g) if s.is_codes
                            else torch.randn(1, s.channels, steps, generator=g))
        return item

    # -------------------------------------------------------------------------------- length sweep
    @property
    def default_sweep_reference(self) -> str:
        return self.spec.package

    def sweep_lengths(self) -> list[int]:
        """About 0.6-12 s of audio in 12 steps, bucket edges of the old default ladder and just past
        them included (mel frames at hop 256; SNAC frames of its coarsest codes)."""
        return list(SWEEP_FRAMES["snac" if self.spec.family == "snac" else "mel"])

    def sweep_ready(self, lengths: list[int]) -> None:
        """Buffers for the longest length (the eager backend runs every call at its own length)."""
        if max(lengths) > self.voc.max_frames:
            v = self.voc
            self.voc = Vocoder(v.family, v.config, v.module, device=v.device, backend=v.backend_name,
                               dtype=v.dtype, buckets=(*v.buckets, max(lengths))).capture()
            self.impl = VocoderRunner(self.impl.name, self.voc)

    def stream_delta(self, inputs: dict[str, torch.Tensor], piece: int = 7) -> float:
        """max |stream - one-shot| for `inputs` fed in pieces of `piece` frames (every input cut at its
        own rate; the stream chunk is the family's)."""
        specs = self.voc.signature.inputs
        values = [inputs[s.name] for s in specs]
        frames = values[0].shape[-1] // specs[0].rate
        pieces = [tuple(v[..., f * s.rate:(f + piece) * s.rate] for v, s in zip(values, specs))
                  for f in range(0, frames, piece)]
        return float((torch.cat(list(self.voc.stream(pieces)), -1) - self.voc(*values)).abs().max())

    def inputs_at(self, frames: int, seed: int) -> dict[str, torch.Tensor]:
        """One input of `frames` frames, drawn as `make_inputs` draws them."""
        return self._draw(frames, torch.Generator().manual_seed(seed))

    def run(self, inputs: Mapping[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        return self.impl.run(inputs, timer)

    def reference(self, name: str) -> Any:
        from flashrt.runtime.graphs import backend_names

        if name == "compile":
            return VocoderRunner("compile", sibling(self.voc, "eager", CompiledFrontend, exact_length=False))
        if name == self.spec.package:
            return self._package_reference()
        backend = name.removesuffix("-backend")
        if backend in backend_names():
            return VocoderRunner(name, sibling(self.voc, backend))
        raise ReferenceUnavailable(f"{self.spec.family} has no reference {name!r}; it offers eager, compile, "
                                   f"{self.spec.package} and the graph backends {backend_names()}")

    def _package_reference(self) -> PackageRunner:
        if self.noise:
            raise ReferenceUnavailable(f"{self.spec.package} draws unseeded noise; with --snac-noise seeded "
                                       "compare against eager or a graph backend")
        if self.folder is None:
            raise ReferenceUnavailable(f"{self.spec.package} is not importable here ({self.package_error}); "
                                       "run under the reference venv (bench/README.md)")
        try:
            decode = _quiet(lambda: self.spec.load(self.folder, self.voc.config, str(self.device)))
        except ImportError as exc:
            raise ReferenceUnavailable(f"{self.spec.package} is not importable here ({exc})") from None
        return PackageRunner(self.spec.package, decode, self.voc)

    def flops_bytes(self) -> tuple[float, float]:
        """FLOPs of one decode of the trace length (`count_flops`), and bytes = weights + inputs + audio."""
        x = self.make_inputs(0)[0]
        tensors = [x[s.name] for s in self.voc.signature.inputs]
        if self._flops is None:
            v = self.voc
            args = [t.to(v.device, v.dtype if t.is_floating_point() else t.dtype) for t in tensors]
            self._flops = count_flops(v.module, args)
        audio = 4 * self.voc.signature.samples(self.frames)
        nbytes = self.memory()["weights"] + sum(t.numel() * t.element_size() for t in tensors) + audio
        return self._flops, float(nbytes)

    def kernels_per_replay(self) -> dict[str, Any]:
        """Kernels one replay of the largest bucket launches on a GPU (a meta count, flashrt.profile)."""
        from flashrt.frontends.vocoders.kernels import kernels_per_replay

        return kernels_per_replay(self.voc.frontend).to_dict()

    def memory(self) -> dict[str, int]:
        tensors = [*self.voc.module.parameters(), *self.voc.module.buffers()]
        return {"buffers": self.voc.buffers.nbytes(),
                "weights": sum(t.numel() * t.element_size() for t in tensors)}

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _factory(name: str) -> Callable[[Profile, str | None, str], VocoderBenchmark]:
    def make(profile: Profile, checkpoint: str | None, device: str) -> VocoderBenchmark:
        return VocoderBenchmark(SPECS[name], profile, checkpoint, device)

    make.__name__ = make.__qualname__ = f"make_{name}_benchmark"
    return make


FACTORIES = {name: _factory(name) for name in SPECS}
_DESCRIPTIONS = {"hifigan": "HiFi-GAN one-shot decode (mel -> audio), V1 sizes on cpu-small",
                 "bigvgan": "BigVGAN one-shot decode (mel -> audio), base 24 kHz sizes on cpu-small",
                 "vocos": "Vocos one-shot decode (mel -> audio), mel 24 kHz sizes on cpu-small",
                 "snac": "SNAC one-shot decode (3-scale codes -> audio), 24 kHz sizes on cpu-small"}
for _name, _make in FACTORIES.items():
    register_benchmark(_name, _make, description=_DESCRIPTIONS[_name])
