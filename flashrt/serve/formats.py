"""Response formats of the speech server: one table (`FORMATS`), name -> how its bytes are made.

    name  sent          rate                                        encoder
    wav   whole file    the voice's                                 written here (true length in the header)
    pcm   streamed      24 kHz (OpenAI's definition)                written here (16-bit LE mono)
    mp3   streamed      the voice's, 24 kHz where MPEG audio has    libsndfile (LAME), constant bit rate
                        no such rate
    opus  streamed      the voice's where Opus has it, else 24 kHz  libsndfile (libopus), Ogg pages of
                                                                    `OPUS_PAGE_MS`
    flac  whole file    the voice's                                 libsndfile (libFLAC), 16-bit

A rate other than the voice's is resampled on the fly with a soxr stream (its chunks concatenate to the
one-shot resampling bit for bit). Every response says its rate in ``X-Sample-Rate``.

Whole or streamed: a format whose header carries the length is sent whole, once the utterance is done,
so that readers which trust the header get the right duration (WAV; FLAC's STREAMINFO holds the
sample count, which libsndfile-based readers such as ``soundfile`` need: a FLAC streamed with the
count unknown is refused by them). Ogg Opus and MP3 are streams by design: each chunk of audio is
encoded and sent as it comes. A streamed file cannot go back to fill in a header at its end: Ogg
carries each page's position, so nothing is lost; MP3 keeps the silent frame that LAME reserves for
its info tag (one frame of silence at the start, besides the usual encoder delay) and uses a constant
bit rate, so that readers derive the duration from the size without that tag.

mp3, opus and flac are encoded by libsndfile through the ``soundfile`` package (``serve`` extra; its
wheels bundle a libsndfile with LAME, mpg123, Opus and FLAC). A format whose encoder is not installed
here (`AudioFormat.missing`) is refused with a 400 that names the formats this server can serve.
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["AudioFormat", "FORMATS", "PCM_RATE", "OPUS_PAGE_MS", "encoder", "wav_header", "sized_wav"]

PCM_RATE = 24_000  # OpenAI's pcm: 24 kHz, 16-bit little-endian, mono; the fallback rate of the codecs
OPUS_PAGE_MS = 100.0  # audio per Ogg page (libsndfile's default, 1 s, would hold back the first audio)
MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@dataclass(frozen=True)
class AudioFormat:
    """One ``response_format``: its media type, whether it streams, its rates and its encoder.

    ``rates`` None takes the voice's rate as it is; otherwise a voice rate outside it is resampled to
    `PCM_RATE`. ``module`` is the package that encodes it (None: written here); ``container`` and
    ``subtype`` name the libsndfile format, ``options`` the ``soundfile.SoundFile`` keywords."""

    name: str
    media_type: str
    streamed: bool
    rates: tuple[int, ...] | None = None
    module: str | None = None
    container: str | None = None
    subtype: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def rate(self, voice_rate: int) -> int:
        if self.rates is None or voice_rate in self.rates:
            return voice_rate
        return PCM_RATE

    def missing(self) -> str | None:
        """Why this format cannot be encoded here (None: it can)."""
        if self.module is None:
            return None
        return _missing(self.module, self.container, self.subtype)


FORMATS: Mapping[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("wav", "audio/wav", streamed=False),
        AudioFormat("pcm", "audio/pcm", streamed=True, rates=(PCM_RATE,)),
        # compression 0.63 at constant bit rate: 64 kbit/s at 16-24 kHz, 128 kbit/s at 32-48 kHz
        AudioFormat("mp3", "audio/mpeg", streamed=True, rates=MPEG_RATES, module="soundfile",
                    container="MP3", subtype="MPEG_LAYER_III",
                    options=(("compression_level", 0.63), ("bitrate_mode", "CONSTANT"))),
        AudioFormat("opus", "audio/ogg", streamed=True, rates=OPUS_RATES, module="soundfile",
                    container="OGG", subtype="OPUS"),
        AudioFormat("flac", "audio/flac", streamed=False, module="soundfile", container="FLAC",
                    subtype="PCM_16"),
    )
}


@functools.cache
def _missing(module: str, container: str | None, subtype: str | None) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"needs the {module} package (pip install 'flashrt[serve]')"
    if module != "soundfile":
        return None
    import soundfile

    if subtype not in soundfile.available_subtypes(container):
        return (f"the libsndfile {soundfile.__libsndfile_version__} under soundfile has no {container} "
                f"{subtype} encoder (soundfile's wheels bundle one that has)")
    return None


def available(formats: Mapping[str, AudioFormat]) -> list[str]:
    """The names of `formats` that can be encoded here, sorted."""
    return sorted(name for name, fmt in formats.items() if fmt.missing() is None)


# ----------------------------------------------------------------------------------------- encoders


class _Resampler:
    """Float chunks at the voice's rate -> float32 chunks at `rate` (identity when they match)."""

    def __init__(self, voice_rate: int, rate: int) -> None:
        self._stream = None
        if rate != voice_rate:
            import soxr

            self._stream = soxr.ResampleStream(voice_rate, rate, 1, dtype="float32", quality="HQ")

    def __call__(self, chunk: Any) -> np.ndarray:
        if self._stream is None:
            return np.asarray(chunk)
        return self._stream.resample_chunk(_float32(chunk), last=False)

    def end(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(_float32([]), last=True)


def _float32(chunk: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).reshape(-1))


def _pcm16(audio: np.ndarray) -> bytes:
    from flashrt.runner.tts import pcm16

    return pcm16(audio)


class PcmEncoder:
    """wav / pcm: 16-bit samples written here. Chunks -> bytes: `head()`, one call per chunk, `end()`;
    `whole(data)` turns everything sent into the file of a whole-file format."""

    def __init__(self, fmt: AudioFormat, voice_rate: int) -> None:
        self.fmt, self.rate = fmt, fmt.rate(voice_rate)
        self._resample = _Resampler(voice_rate, self.rate)

    def head(self) -> bytes:
        return wav_header(self.rate) if self.fmt.name == "wav" else b""

    def __call__(self, chunk: Any) -> bytes:
        return _pcm16(self._resample(chunk))

    def end(self) -> bytes:
        return _pcm16(self._resample.end())

    def whole(self, data: bytes) -> bytes:
        return sized_wav(data) if self.fmt.name == "wav" else data

    def close(self) -> None:
        pass


class SoundFileEncoder:
    """mp3 / opus / flac through libsndfile, writing into a `_Sink` (same verbs as `PcmEncoder`)."""

    def __init__(self, fmt: AudioFormat, voice_rate: int) -> None:
        import soundfile

        self.fmt, self.rate = fmt, fmt.rate(voice_rate)
        self._resample = _Resampler(voice_rate, self.rate)
        self._sink = _Sink(streamed=fmt.streamed)
        self._file = soundfile.SoundFile(self._sink, "w", samplerate=self.rate, channels=1,
                                         format=fmt.container, subtype=fmt.subtype, **dict(fmt.options))
        if fmt.container == "OGG":
            _set_ogg_page_ms(self._file, OPUS_PAGE_MS)

    def head(self) -> bytes:
        return b""

    def __call__(self, chunk: Any) -> bytes:
        self._write(self._resample(chunk))
        return self._sink.take()

    def end(self) -> bytes:
        self._write(self._resample.end())
        self._file.close()
        return self._sink.take(final=True)

    def whole(self, data: bytes) -> bytes:
        return data

    def close(self) -> None:
        """Free the encoder of a request that ends early (a no-op after `end`)."""
        self._file.close()

    def _write(self, audio: np.ndarray) -> None:
        if audio.size:
            self._file.write(_float32(audio))


def _set_ogg_page_ms(file: Any, ms: float) -> bool:
    """libsndfile's SFC_SET_OGG_PAGE_LATENCY_MS (0x1302), which `soundfile` does not wrap, through its
    cffi handles: audio per Ogg page. False (pages of libsndfile's default, 1 s: the stream is still
    right, its first audio later) where a soundfile release no longer has those handles."""
    import soundfile

    try:
        ffi, lib, handle = soundfile._ffi, soundfile._snd, file._file
    except AttributeError:
        return False
    lib.sf_command(handle, 0x1302, ffi.new("double*", ms), ffi.sizeof("double"))
    return True


class _Sink:
    """The file libsndfile writes into (it seeks and writes; reads find nothing).

    Streamed: `take()` hands over what was written since the last call; a later write over bytes
    already handed over (a header filled in at close) is dropped, since a stream cannot go back.
    Whole: nothing is handed over before ``take(final=True)``, so every such write lands."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self._data = bytearray()  # bytes from offset `_base` on
        self._base = 0  # bytes handed over
        self._pos = 0

    def take(self, final: bool = False) -> bytes:
        if not (self.streamed or final):
            return b""
        out = bytes(self._data)
        self._base += len(out)
        self._data.clear()
        return out

    def write(self, data: Any) -> int:
        data = bytes(data)
        start, stop = max(self._pos, self._base), self._pos + len(data)
        if stop > start:
            lo = start - self._base
            if lo > len(self._data):
                self._data.extend(bytes(lo - len(self._data)))
            self._data[lo:lo + stop - start] = data[start - self._pos:]
        self._pos = stop
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        origin = (0, self._pos, self._base + len(self._data))[whence]
        self._pos = origin + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""


ENCODERS = {None: PcmEncoder, "soundfile": SoundFileEncoder}


def encoder(fmt: AudioFormat, voice_rate: int) -> PcmEncoder | SoundFileEncoder:
    """A fresh encoder of one response in `fmt` for a voice of `voice_rate` Hz."""
    return ENCODERS[fmt.module](fmt, int(voice_rate))


# ------------------------------------------------------------------------------------------------ wav


def wav_header(sample_rate: int) -> bytes:
    """A streaming WAV header: mono 16-bit PCM, RIFF and data sizes unknown (0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", unknown)
    )


def sized_wav(data: bytes) -> bytes:
    """`data` (a `wav_header` and its samples) with the RIFF and data sizes filled in."""
    return (data[:4] + struct.pack("<I", len(data) - 8) + data[8:40] + struct.pack("<I", len(data) - 44)
            + data[44:])
