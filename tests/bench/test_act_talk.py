"""`flashrt bench act-and-talk` end to end (a short run: the loop and the speech ran in both setups,
the runtime one through its lanes) and its bad options (one line, the JSON line, no folder)."""

import json

import pytest


def _run(args, capsys):
    from flashrt.cli import main

    code = main(["bench", "act-and-talk", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def test_a_short_run_reports_both_setups(tmp_path, capsys):
    code, line, err = _run(["--ticks", "20", "--sweep", "40", "--sweep-ticks", "10", "--frames", "6",
                            "--no-plot", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert line["status"] == "ok" and {"naive_misses", "runtime_misses"} <= set(line)
    record = json.loads((tmp_path / "results.json").read_text())
    runtime = record["setups"]["runtime"]
    assert runtime["lanes"]["policy"]["calls"] == 20 and runtime["lanes"]["speech"]["replays"] > 0
    assert record["setups"]["naive"]["ticks"] == 20 and record["sweep"][0]["rate_hz"] == 40.0
    for setup in record["setups"].values():
        assert setup["speech_audio_s"] > 0 and not setup["speech_errors"]
    trace = json.loads((tmp_path / "act_talk_trace.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"policy", "speech"}


@pytest.mark.parametrize("args", [["--rate-hz", "0"], ["--ticks", "0"], ["--sweep", "20,x"]])
def test_bad_options_are_one_line(args, tmp_path, capsys):
    code, line, err = _run([*args, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and line["status"] == "error" and not (tmp_path / "out").exists()


def test_the_gpu_scripts_act_and_talk_row_runs_its_cpu_smoke_form():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "act_talk_gpu.py"), "--device", "cpu",
                           "--preset", "tiny", "--ticks", "10", "--frames", "3", "--rate-hz", "20"],
                          capture_output=True, text=True, timeout=240, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["status"] == "ok" and {"naive", "runtime"} == set(line["setups"])
    assert line["setups"]["runtime"]["ticks"] == 10
