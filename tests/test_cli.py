"""flashrt/cli.py: a user error prints one line and exits 2, never a traceback (unless --debug); a bug says
it is one (exit 1). Every case runs `flashrt.cli.main` in-process, as the console script does."""

from __future__ import annotations

import pytest
import torch

from flashrt.cli import describe_error, main
from flashrt.errors import CheckpointError, ConfigError, DeviceError, InputError

pytestmark = pytest.mark.timeout(300)


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("flashrt: ")]
    assert len(lines) == 1 and lines[0].startswith("flashrt: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    (tmp_path / "bad.toml").write_text("[bench]\niters = -1\n")
    (tmp_path / "junk.pt").write_bytes(b"hello\n")
    (tmp_path / "a-file").write_text("x")
    return tmp_path


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

CASES = {
    "info cuda on a CPU box": (["info", "--device", "cuda"], ["CUDA is not available"], [NO_CUDA]),
    "info cuda:7 on a CPU box": (["info", "--device", "cuda:7"], ["cuda"], [NO_CUDA]),
    "info tpu": (["info", "--device", "tpu"], ["unknown device 'tpu'", "flashrt info"], []),
    "info empty device": (["info", "--device", ""], ["unknown device"], []),
    "demo negative rate": (["demo", "--rate-hz", "-5"], ["--rate-hz", "positive"], []),
    "demo zero rate": (["demo", "--rate-hz", "0"], ["--rate-hz", "positive"], []),
    "demo zero seconds": (["demo", "--seconds", "0"], ["seconds"], []),
    "demo rate not a number": (["demo", "--rate-hz", "abc"], [], []),
    "demo unknown device": (["demo", "--device", "tpu", "--checkpoint", "{t}/demo"], ["'tpu'"], []),
    "demo cuda on a CPU box": (["demo", "--device", "cuda", "--checkpoint", "{t}/demo"], ["CUDA"], [NO_CUDA]),
    "demo unknown backend": (["demo", "--backend", "foo", "--checkpoint", "{t}/demo"], ["'foo'"], []),
    "demo folder is a file": (["demo", "--checkpoint", "{t}/a-file"], ["a-file"], []),
    "profile is a directory": (["bench", "-p", "{t}/dir.toml", "--out", "{t}/o"], ["directory"], []),
    "profile is binary": (["bench", "-p", "{t}/binary.toml", "--out", "{t}/o"], ["not UTF-8"], []),
    "profile has a bad value": (["bench", "-p", "{t}/bad.toml", "--out", "{t}/o"], ["iters"], []),
    "profile is missing": (["bench", "-p", "{t}/absent.toml", "--out", "{t}/o"], ["not found"], []),
    "unknown profile name": (["bench", "-p", "nope", "--out", "{t}/o"], ["no profile named 'nope'"], []),
    "trace file missing": (["bench", "--trace", "{t}/absent.pt", "--out", "{t}/o", "--no-progress"],
                           ["trace file", "not found"], []),
    "trace file is junk": (["bench", "--trace", "{t}/junk.pt", "--out", "{t}/o", "--no-progress"],
                           ["not a readable trace file"], []),
    "bench --out under a file": (["bench", "--out", "{t}/a-file/out"], ["--out", "choose a writable"], []),
    "loop --out under a file": (["loop", "--out", "{t}/a-file/out"], ["--out"], []),
    "soak --out under a file": (["soak", "--out", "{t}/a-file/out"], ["--out"], []),
    "unknown benchmark": (["bench", "nope", "--out", "{t}/o"], ["no benchmark named 'nope'"], []),
    "loop bad rate": (["loop", "--rate", "-3", "--out", "{t}/o", "--no-plot"], ["rate"], []),
    "soak bad steps": (["soak", "--steps", "5", "--out", "{t}/o", "--no-plot", "--no-progress"],
                       ["steps"], []),
    "loop zero rate": (["loop", "--rate", "0", "--steps", "3", "--out", "{t}/o", "--no-plot"],
                       ["--rate"], []),
    "soak zero steps": (["soak", "--steps", "0", "--out", "{t}/o", "--no-plot", "--no-progress"],
                        ["steps"], []),
    "bench zero iters": (["bench", "pi05", "--iters", "0", "--out", "{t}/o", "--no-progress"],
                         ["--iters 0"], []),
    "bench negative warmup": (["bench", "--warmup", "-1", "--out", "{t}/o", "--no-progress"],
                              ["--warmup -1"], []),
    "say unknown device": (["say", "hello", "--device", "tpu", "-o", "{t}/x.wav"],
                           ["unknown device 'tpu'", "flashrt info"], []),
    "say cuda on a CPU box": (["say", "hello", "--device", "cuda", "-o", "{t}/x.wav"], ["CUDA"], [NO_CUDA]),
    "say --out in a missing folder": (["say", "hello", "--out", "{t}/nonexistent_dir/x.wav"],
                                      ["nonexistent_dir", "does not exist"], []),
    "say --out is a folder": (["say", "hello", "--out", "{t}"], ["is a folder"], []),
    "say unknown decoder precision": (["say", "hello", "--decoder-precision", "fp16", "-o", "{t}/x.wav"],
                                      ["decoder_precision 'fp16'", "bf16"], []),
    "serve negative port": (["serve", "--port", "-5", "--no-warmup"], ["--port -5", "0..65535"], []),
    "serve port too large": (["serve", "--port", "70000", "--no-warmup"], ["--port 70000"], []),
    "serve zero max pending": (["serve", "--max-pending", "0", "--no-warmup"], ["--max-pending 0"], []),
    "serve unknown device": (["serve", "--device", "tpu", "--no-warmup"], ["unknown device 'tpu'"], []),
}


def _case(name):
    argv, needles, marks = CASES[name]
    return pytest.param(argv, needles, id=name, marks=marks)


@pytest.mark.parametrize(("argv", "needles"), [_case(n) for n in CASES])
def test_user_errors_are_one_line_and_exit_2(capsys, files, argv, needles):
    argv = [a.format(t=files) for a in argv]
    code, out, err = _run(capsys, argv)
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    if "--rate-hz" in argv and "abc" in argv:  # click's own usage error: its box, exit 2
        return
    if argv[0] in ("bench", "loop", "soak") and "flashrt: error" not in err:  # the bench's own contract:
        assert any(n in err for n in needles), err                           # a line on stderr and
        assert out.strip().splitlines()[-1].startswith("{")                  # the JSON line last
    else:
        _one_line_error(code, err, *needles)


def test_cache_rm_in_a_read_only_folder(capsys, tmp_path, monkeypatch):
    from pathlib import Path

    from support.quant_cache import make_key, make_scales

    from flashrt.quant.cache import CalibrationCache

    cache = CalibrationCache(tmp_path)
    name = cache.store(make_key(), make_scales()).name

    def read_only(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)  # chmod does not stop root, this does
    code, _, err = _run(capsys, ["cache", "rm", name, "--dir", str(tmp_path)])
    _one_line_error(code, err, name, "permission denied", "check the permissions")


def test_cache_rm_all_in_a_missing_folder_is_one_line(capsys, tmp_path):
    """An explicitly named --dir that does not exist is a mistyped path, for rm as for ls and
    verify: one line naming it, exit 2, nothing touched."""
    code, _, err = _run(capsys, ["cache", "rm", "--all", "--dir", str(tmp_path / "absent")])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "absent" in err and "does not exist" in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(DeviceError):
        main(["info", "--device", "tpu", "--debug"])


def test_usage_errors_keep_click_exit_code(capsys):
    code, _, err = _run(capsys, ["info", "--no-such-option"])
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize(("exc", "code", "needle"), [
    (DeviceError("no GPU"), 2, "flashrt info"),
    (ConfigError("bad rate"), 2, "fix the value"),
    (CheckpointError("no weights"), 2, "check the checkpoint"),
    (InputError("bad image"), 2, "fix the value"),
    (FileNotFoundError(2, "No such file or directory", "/x/y"), 2, "/x/y: no such file or directory"),
    (PermissionError(13, "Permission denied", "/ro"), 2, "/ro: permission denied"),
    (IsADirectoryError(21, "Is a directory", "/d"), 2, "/d: is a directory"),
    (ValueError("rate_hz must be positive"), 2, "rate_hz must be positive"),
    (KeyError("slot"), 1, "internal error: KeyError"),
    (ZeroDivisionError("division by zero"), 1, "a bug in flashrt"),
])
def test_describe_error(exc, code, needle):
    line, got = describe_error(exc)
    assert got == code and needle in line and "\n" not in line


def test_a_bug_is_reported_as_one(capsys, monkeypatch):
    import flashrt.runtime.device as device

    def broken(spec):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(device, "describe_device", broken)
    code, _, err = _run(capsys, ["info"])
    assert code == 1 and "internal error: ZeroDivisionError" in err and "Traceback" not in err


def test_bench_standalone_entry_uses_the_same_handler(capsys, monkeypatch, tmp_path):
    import sys

    from flashrt.bench import cli as bench_cli

    monkeypatch.setattr(sys, "argv", ["flashrt-bench", "bench", "--out", str(tmp_path / "x" / "y")])
    (tmp_path / "x").write_text("a file")
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main()
    assert exit_info.value.code == 2
    assert "flashrt-bench: error: --out" in capsys.readouterr().err


def test_version_is_single_sourced(capsys):
    import importlib.metadata

    import flashrt

    code, out, _ = _run(capsys, ["--version"])
    assert code == 0 and out.strip() == f"flashrt {flashrt.__version__}"
    assert importlib.metadata.version("flashrt") == flashrt.__version__


def test_verbose_turns_on_logging(capsys, monkeypatch):
    import logging

    calls = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: calls.append(kw["level"]))
    assert _run(capsys, ["-vv", "info", "--json"])[0] == 0
    assert calls == [logging.DEBUG]
    assert _run(capsys, ["-v", "info", "--json"])[0] == 0
    assert calls == [logging.DEBUG, logging.INFO]


def test_quiet_by_default(capsys, monkeypatch):
    """No -v: logging is not configured, so flashrt's INFO lines (load, capture, calibration) stay
    silent and the capture progress bar stays off."""
    import logging

    calls = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: calls.append(kw["level"]))
    code, out, err = _run(capsys, ["info", "--json"])
    assert code == 0 and calls == [] and err == ""
    assert not logging.getLogger("flashrt.runtime.buckets").isEnabledFor(logging.INFO)


def test_a_mistyped_bench_name_writes_nothing(capsys, tmp_path):
    out = tmp_path / "o"
    code, stdout, err = _run(capsys, ["bench", "nope", "--out", str(out)])
    assert code == 2 and "no benchmark named 'nope'" in err
    assert stdout.strip().splitlines()[-1].startswith("{")  # the bench contract: the JSON line last
    assert not out.exists()
