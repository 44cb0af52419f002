"""The speech server's response formats (`flashrt.serve.formats`): the sink libsndfile writes into, the
rates, a format whose encoder is missing from the registry (a 400 naming the formats served), and the
encoders' streaming. Each format through a running server: tests/serve/test_speech_server.py."""

import dataclasses
import io

import numpy as np
import pytest

from flashrt.serve.formats import FORMATS, _Sink, encoder

# --------------------------------------------------------------------------------- no server needed


def test_a_streamed_sink_drops_writes_over_bytes_already_sent():
    sink = _Sink(streamed=True)
    sink.write(b"HEAD....")
    assert sink.take() == b"HEAD...."
    sink.write(b"audio")
    sink.seek(0)
    sink.write(b"DONE")  # a header filled in at close: too late for a stream
    sink.seek(0, 2)
    sink.write(b"!")
    assert sink.take(final=True) == b"audio!" and sink.tell() == len(b"HEAD....audio!")


def test_a_whole_sink_hands_over_nothing_before_the_end_and_keeps_every_write():
    sink = _Sink(streamed=False)
    sink.write(b"HEAD....audio")
    sink.seek(0)
    sink.write(b"DONE")
    assert sink.take() == b"" and sink.take(final=True) == b"DONE....audio"


def test_each_format_takes_the_voice_rate_or_24khz():
    assert FORMATS["pcm"].rate(22050) == 24000 and FORMATS["wav"].rate(22050) == 22050
    assert FORMATS["mp3"].rate(22050) == 22050 and FORMATS["mp3"].rate(22000) == 24000
    assert FORMATS["opus"].rate(22050) == 24000 and FORMATS["opus"].rate(16000) == 16000
    assert FORMATS["flac"].rate(22050) == 22050


def test_a_format_whose_encoder_is_missing_is_a_400_naming_the_formats_served():
    from flashrt.serve.app import ApiError, SpeechServer

    class Voice:
        sample_rate = 8000

    absent = {name: dataclasses.replace(fmt, module="flashrt_no_such_encoder") if fmt.module else fmt
              for name, fmt in FORMATS.items()}
    speech = SpeechServer({"v": Voice()}, formats=absent)
    body = b'{"model": "v", "voice": "v", "input": "hi", "response_format": "%s"}'
    try:
        for fmt in ("mp3", "opus", "flac"):
            with pytest.raises(ApiError) as err:
                speech.parse(body % fmt.encode())
            assert (err.value.status, err.value.param, err.value.code) == (400, "response_format",
                                                                           "unsupported_format")
            assert "flashrt_no_such_encoder" in err.value.message and "['pcm', 'wav']" in err.value.message
        assert speech.parse(body % b"pcm").fmt == "pcm"
        with pytest.raises(ApiError) as err:
            speech.parse(body % b"aac")
        assert "not supported" in err.value.message and "['pcm', 'wav']" in err.value.message
        assert speech.health()["formats"] == ["pcm", "wav"]
    finally:
        speech.close()


# ---------------------------------------------------------------------------- encoders (soundfile)


@pytest.fixture(scope="module")
def sf():
    return pytest.importorskip("soundfile")


def _tone(rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2).astype(np.float32)


@pytest.mark.parametrize("name", ["mp3", "opus"])
def test_streamed_formats_hand_over_audio_while_it_comes(sf, name):
    """Chunks of 0.1 s go out encoded before the end: Ogg pages of OPUS_PAGE_MS, not libsndfile's
    default of one page a second; MP3 frame by frame."""
    enc = encoder(FORMATS[name], 24000)
    audio = _tone(24000, 1.0)
    sizes = [len(enc(audio[i:i + 2400])) for i in range(0, len(audio), 2400)]
    assert sum(size > 0 for size in sizes[1:]) >= 6, sizes
    assert len(enc.end()) > 0


def test_flac_is_whole_and_its_header_has_the_length(sf):
    enc = encoder(FORMATS["flac"], 16000)
    audio = _tone(16000, 0.5)
    sent = b"".join(enc(audio[i:i + 1600]) for i in range(0, len(audio), 1600))
    data = enc.whole(sent + enc.end())
    assert sent == b""  # nothing before the end: STREAMINFO is filled in at close
    with sf.SoundFile(io.BytesIO(data)) as f:
        assert (f.frames, f.samplerate) == (len(audio), 16000)
        got = f.read(dtype="int16")
    want = np.frombuffer(_pcm16(audio), dtype="<i2")
    assert np.abs(got.astype(np.int32) - want).max() <= 1


def _pcm16(audio):
    from flashrt.runner.tts import pcm16

    return pcm16(audio)
