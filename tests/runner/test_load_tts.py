"""load_tts / flashrt say through the TTS family registry (a toy family: no weights, fast)."""

import wave

import numpy as np
import pytest
from typer.testing import CliRunner

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.registry import TtsFamily, register_tts_family, tts_families, unregister_tts_family
from flashrt.runner.tts import load_tts, pcm16


class _Toy:
    sample_rate = 8000

    def __init__(self, **options):
        self.options = options

    def __call__(self, text, seed=None, speed=1.0):
        return np.concatenate(list(self.stream(text, seed=seed, speed=speed)))

    def stream(self, text, seed=None, speed=1.0):
        for i, _ in enumerate(text.split()):
            yield np.full(80, 0.1 * (i + 1), dtype=np.float32)


def _detect(source):
    if not str(source).startswith("toy:"):
        raise CheckpointError(f"{source}: not a toy voice")


@pytest.fixture
def toy():
    family = register_tts_family(TtsFamily("toy", _detect, lambda source, **o: _Toy(**o)))
    yield family
    unregister_tts_family("toy")


def test_vits_is_registered():
    assert "vits" in tts_families()


def test_load_tts_picks_the_family_that_claims_the_source(toy):
    tts = load_tts("toy:a", device="cpu")
    assert isinstance(tts, _Toy) and tts.options["device"] == "cpu"
    with pytest.raises(ConfigError, match="unknown tts family"):
        load_tts("toy:a", family="nope")


def test_unclaimed_source_lists_every_family_and_why(toy):
    with pytest.raises(CheckpointError) as err:
        load_tts("/no/such/voice")
    assert "toy:" in str(err.value) and "vits:" in str(err.value)


def test_say_writes_a_wav(toy, tmp_path):
    from flashrt.cli import app

    out = tmp_path / "x.wav"
    result = CliRunner().invoke(app, ["say", "one two three", "--voice", "toy:a", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with wave.open(str(out)) as w:
        assert w.getframerate() == 8000 and w.getnframes() == 240
        data = np.frombuffer(w.readframes(240), dtype="<i2")
    assert data[0] == np.frombuffer(pcm16(np.array([0.1], np.float32)), "<i2")[0]


def test_builtin_family_cannot_be_removed():
    with pytest.raises(ConfigError):
        unregister_tts_family("vits")


def test_an_option_the_family_does_not_take_is_refused_in_one_line(toy, tmp_path, capsys):
    from flashrt.cli import main

    with pytest.raises(ConfigError, match=r"toy models take no option\(s\) \['snac_noise'\]"):
        load_tts("toy:a", snac_noise="seeded")
    argv = ["say", "one", "--voice", "toy:a", "--snac-noise", "seeded", "-o", str(tmp_path / "x.wav")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "snac_noise" in err and "Traceback" not in err and not (tmp_path / "x.wav").exists()


def test_say_reads_stdin_and_writes_raw_pcm_to_stdout(toy):
    """Like piper's CLI: text on standard input, `-o -` raw 16-bit PCM on standard output, the rate on
    standard error."""
    from flashrt.cli import app

    result = CliRunner().invoke(app, ["say", "--voice", "toy:a", "-o", "-"], input="one two\n")
    assert result.exit_code == 0, result.output
    pcm = np.frombuffer(result.stdout_bytes, dtype="<i2")
    spoken = np.concatenate([np.full(80, 0.1), np.full(80, 0.2)]).astype(np.float32)
    want = np.frombuffer(pcm16(spoken), "<i2")
    assert np.array_equal(pcm, want)
    assert "8000 Hz" in result.stderr


def test_say_normalizes_the_peak(toy, tmp_path):
    from flashrt.cli import app

    out = tmp_path / "x.wav"
    result = CliRunner().invoke(app, ["say", "one two", "--voice", "toy:a", "--normalize", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with wave.open(str(out)) as w:
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert abs(int(np.abs(data).max()) - round(32767 * 10 ** (-1 / 20))) <= 1
    assert abs(int(data[0]) - round(32767 * 10 ** (-1 / 20) / 2)) <= 1  # the quieter word keeps its ratio


def test_say_without_text_says_so(toy, capsys):
    import io
    import sys

    from flashrt.cli import main

    old, sys.stdin = sys.stdin, io.StringIO("  \n")
    try:
        assert main(["say", "--voice", "toy:a", "-o", "-"]) == 2
    finally:
        sys.stdin = old
    assert "no text" in capsys.readouterr().err


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_write_wav_to_a_missing_folder_is_one_os_error(tmp_path):
    import gc

    from flashrt.runner.tts import write_wav

    with pytest.raises(FileNotFoundError):
        write_wav(tmp_path / "absent" / "x.wav", np.zeros(10, np.float32), 16000)
    gc.collect()  # wave.open(path) left a half-built writer whose __del__ raised here
    write_wav(tmp_path / "x.wav", np.full(10, 0.5, np.float32), 16000)
    with wave.open(str(tmp_path / "x.wav")) as f:
        assert (f.getframerate(), f.getnframes(), f.getsampwidth()) == (16000, 10, 2)


def test_load_tts_refuses_an_unknown_device_before_loading():
    from flashrt.errors import DeviceError

    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        load_tts("no-such-voice", device="tpu")
