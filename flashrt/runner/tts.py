"""`flashrt.load_tts` and `flashrt say`: one entry for every text-to-speech family.

    tts = flashrt.load_tts("en_US-joe-medium")      # a voice name, a folder or a file
    audio = tts("Hello there.")                      # float32 (N,) in [-1, 1] at tts.sample_rate
    for chunk in tts.stream("Hello there."):         # streamed; concatenation equals tts(text)
        play(chunk)

The family is found through `flashrt.frontends.registry.TTS_FAMILIES` (each family's `detect` says
whether a source is its own), or named with ``family=``.

Piper voices by catalogue name (``en_US-lessac-medium``) come from a local voice folder: the ones given
as ``voices_dir=`` / ``--voices-dir``, then piper's default (the working directory), then the local
Hugging Face cache of rhasspy/piper-voices, then the installed voice packages; never downloaded
(`flashrt.frontends.vits.catalogue`).

    flashrt say "Hello there." --voice en_US-joe-medium -o hello.wav
    flashrt say "Hello there." --voice en_US-lessac-medium --voices-dir ~/piper-voices -o hello.wav
"""

from __future__ import annotations

import os
import sys
import wave
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io.inputs import check_seed, check_speed, check_text_chars

__all__ = ["load_tts", "say", "write_wav", "pcm16", "check_writable_file", "check_request", "peak_normalize"]


def load_tts(
    source: str | Path,
    family: str | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    backend: str | None = None,
    voices_dir: str | Path | list[str | Path] | None = None,
    **options: Any,
) -> Any:
    """Load a speech model from `source` with the family that claims it (or the one named).
    `voices_dir`: Piper voice folders where a voice name is looked up first (giving them says that
    `source` is a Piper voice: a name found nowhere is an error listing every place searched)."""
    from flashrt.frontends.registry import tts_families
    from flashrt.runtime.device import resolve_device

    resolve_device(device)  # an unknown or absent device is a DeviceError now, not torch's error later
    if voices_dir is not None and not Path(source).expanduser().exists():
        from flashrt.frontends.vits.voice import find_voice

        source = find_voice(source, voices_dir).weights
    families = tts_families()
    if family is not None:
        if family not in families:
            raise ConfigError(f"unknown tts family {family!r}; known: {sorted(families)}")
        chosen = families[family]
    else:
        reasons, chosen = [], None
        for fam in families.values():
            try:
                fam.detect(source)
            except CheckpointError as exc:
                reasons.append(f"{fam.name}: {exc}")
                continue
            chosen = fam
            break
        if chosen is None:
            raise CheckpointError(f"{source}: no tts family claims it ({'; '.join(reasons) or 'none known'})")
    unknown = sorted(set(options) - set(chosen.options))
    if unknown:
        raise ConfigError(f"{source}: {chosen.name} models take no option(s) {unknown}; their options: "
                          f"{sorted(chosen.options)}")
    return chosen.load(source, device=device, precision=precision, backend=backend, **options)


def pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> little-endian 16-bit PCM bytes (clipped)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """16-bit mono WAV. The file is opened first, so a path that cannot be written is one OSError
    (`wave.open` on a path leaves a half-built writer that complains again when collected)."""
    with open(path, "wb") as f, wave.open(f, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes(pcm16(audio))


def check_writable_file(path: Path, flag: str = "--out") -> None:
    """ConfigError unless `path` can be created or overwritten: checked before a model is loaded, so a
    bad output path fails in a second, not after the work."""
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name a file in it (e.g. {path / 'out.wav'})")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable; choose a writable path")


SnacNoiseOpt = Annotated[str | None, typer.Option(
    "--snac-noise", help="SNAC decoders (Orpheus): 'off' (default) drops the released decoder's noise "
    "(deterministic); 'seeded' adds it, drawn reproducibly from the sample position")]


VoicesDirOpt = Annotated[list[Path] | None, typer.Option(
    "--voices-dir", help="a folder of Piper voices (<name>.onnx + <name>.onnx.json, or the catalogue's "
    "tree) where a voice name is looked up first; repeatable. Then piper's default: the working directory")]


def snac_options(snac_noise: str | None) -> dict[str, Any]:
    """load_tts options of `--snac-noise` (none when not given, so other families load as before)."""
    return {"snac_noise": snac_noise} if snac_noise is not None else {}


STDIN_LIMIT = 1 << 20  # characters of text read from standard input


def say(
    text: Annotated[str | None, typer.Argument(help="what to say; '-' or none: read it from standard input")]
    = None,
    voice: Annotated[
        str, typer.Option("--voice", "--model", "-v", help="voice/model: a folder, a file or a name")
    ] = "en_US-joe-medium",
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="the WAV file to write; '-': raw 16-bit little-endian PCM on standard output "
        "(as piper's --output-raw; messages go to standard error)")] = Path("out.wav"),
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    speed: Annotated[float, typer.Option(help="speaking rate, 0.25-4")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="noise seed (reproducible speech)")] = None,
    speaker: Annotated[str | None, typer.Option(help="speaker of a multi-voice model (Orpheus: tara, leo)")]
    = None,
    normalize: Annotated[bool, typer.Option(
        help="scale the audio so its peak is at -1 dBFS (quiet voices, clipped ones)")] = False,
    snac_noise: SnacNoiseOpt = None,
    voices_dir: VoicesDirOpt = None,
    decoder_precision: Annotated[str | None, typer.Option(
        "--decoder-precision", help="Piper voices: 'bf16' runs the HiFi-GAN decoder in bfloat16 behind the "
        "float32 prior (~1.25x faster on CPUs with AVX512-BF16; not the float32 audio: "
        "docs/benchmarks/tts.md)")] = None,
) -> None:
    """Speak TEXT (or standard input) into a WAV file, or as raw PCM to standard output."""
    raw = str(out) == "-"
    if not raw:
        check_writable_file(out)
    text = _text_or_stdin(text)
    check_request(text, seed, speed)
    precision = {"decoder_precision": decoder_precision} if decoder_precision else {}
    tts = load_tts(voice, device=device, voices_dir=voices_dir, **snac_options(snac_noise), **precision)
    extra = {"voice": speaker} if speaker else {}
    chunks = list(tts.stream(text, seed=seed, speed=speed, **extra))
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if normalize:
        audio = peak_normalize(audio)
    seconds = f"{audio.size / tts.sample_rate:.2f} s at {tts.sample_rate} Hz"
    if raw:
        sys.stdout.buffer.write(pcm16(audio))
        sys.stdout.buffer.flush()
        typer.echo(f"raw 16-bit mono PCM: {seconds}", err=True)
    else:
        write_wav(out, audio, tts.sample_rate)
        typer.echo(f"{out}: {seconds}")
    report = getattr(tts, "report", None)
    if callable(report):
        _echo_report(report(), err=raw)


def check_request(text: str, seed: Any, speed: Any) -> None:
    """The checks every family applies to a request (`flashrt.io.inputs`: text characters, the seed rule,
    the speed range), run before a model is loaded so a bad request fails in a second, not after it."""
    check_text_chars(text)
    check_seed(seed)
    check_speed(speed)


def _text_or_stdin(text: str | None) -> str:
    if text is not None and text != "-":
        return text
    data = sys.stdin.read(STDIN_LIMIT + 1)
    if len(data) > STDIN_LIMIT:
        raise ConfigError(f"standard input holds more than {STDIN_LIMIT} characters; split the text")
    if not data.strip():
        raise ConfigError("no text: give it as an argument or on standard input")
    return data


def peak_normalize(audio: np.ndarray, peak_db: float = -1.0) -> np.ndarray:
    """`audio` scaled so that its largest magnitude sits at ``peak_db`` dBFS (silence stays silence)."""
    top = float(np.max(np.abs(audio))) if audio.size else 0.0
    if top == 0.0:
        return audio
    return (audio * (10 ** (peak_db / 20) / top)).astype(np.float32)


def _echo_report(report: dict[str, Any], err: bool = False) -> None:
    """TTFA, RTF and per-stage times of a family that reports them (e.g. the Orpheus chain)."""
    if report.get("ttfa_ms") is not None:
        typer.echo(f"TTFA {report['ttfa_ms']:.1f} ms, RTF {report.get('rtf') or float('nan'):.3f}", err=err)
    for name, stage in (report.get("stages") or {}).items():
        service = stage.get("service_ms", {})
        if service.get("count"):
            total = service["mean"] * service["count"]
            typer.echo(f"  {name:8} {service['count']:5d} items  p50 {service['p50']:.2f} ms  "
                       f"p99 {service['p99']:.2f} ms  total {total:.1f} ms", err=err)
