import json

import pytest
import torch
import typer
from support.bench_fakes import register_fake
from typer.testing import CliRunner

from flashrt.bench.cli import bench, loop, soak


@pytest.fixture
def app():
    app = typer.Typer()
    for command in (bench, loop, soak):
        app.command()(command)
    return app


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "quick.toml"
    path.write_text('[device]\nkind = "cpu"\nthreads = 1\n[bench]\nwarmup = 1\niters = 5\ntrace_len = 2\n'
                    'soak_steps = 200\n')
    return str(path)


def _last_json(output):
    return json.loads(output.strip().splitlines()[-1])


def test_bench_prints_json_line_last_and_writes_files(app, tmp_path, profile_file, fake_name):
    register_fake(fake_name)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["bench", fake_name, "-p", profile_file, "--vs", "eager", "--out", str(out),
                                   "--no-progress", "--save-trace"])
    assert res.exit_code == 0, res.output
    line = _last_json(res.stdout)
    assert line["status"] == "ok" and line["vs"] == "eager" and line["results"] == str(out / "results.json")
    data = json.loads((out / "results.json").read_text())
    assert data["steady"]["iters"] == 5 and data["files"]["trace"] == str(out / "trace.pt")
    assert (out / "latency.png").stat().st_size > 20_000
    again = CliRunner().invoke(app, ["bench", fake_name, "-p", profile_file, "--trace", str(out / "trace.pt"),
                                     "--out", str(tmp_path / "again"), "--no-progress", "--no-plot"])
    assert _last_json(again.stdout)["trace_digest"] == line["trace_digest"]


def test_bench_gated_out_exit_code(app, tmp_path, profile_file, fake_name):
    register_fake(fake_name, offset=0.5)
    res = CliRunner().invoke(app, ["bench", fake_name, "-p", profile_file, "--out", str(tmp_path / "g"),
                                   "--no-progress", "--no-plot"])
    assert res.exit_code == 1 and _last_json(res.stdout)["status"] == "gated-out"


def test_bench_config_error_and_list(app, tmp_path):
    res = CliRunner().invoke(app, ["bench", "no-such-bench", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and _last_json(res.stdout)["status"] == "error"
    listed = CliRunner().invoke(app, ["bench", "--list"])
    assert "runtime-block" in listed.stdout and "cpu-tiny" in listed.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_profile_refused(app, tmp_path):
    res = CliRunner().invoke(app, ["bench", "runtime-block", "-p", "h200-bf16", "--out", str(tmp_path / "r")])
    line = _last_json(res.stdout)
    assert res.exit_code == 3 and line["status"] == "refused" and "CUDA" in line["reason"]


def test_loop_and_soak_commands(app, tmp_path, profile_file, fake_name):
    register_fake(fake_name)
    res = CliRunner().invoke(app, ["loop", fake_name, "-p", profile_file, "--steps", "20", "--rate", "500",
                                   "--out", str(tmp_path / "l")])
    assert res.exit_code == 0, res.output
    assert _last_json(res.stdout)["kind"] == "loop" and (tmp_path / "l" / "loop.png").exists()
    res = CliRunner().invoke(app, ["soak", fake_name, "-p", profile_file, "--out", str(tmp_path / "s"),
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    line = _last_json(res.stdout)
    assert line["kind"] == "soak" and line["steps"] == 200 and not line["leak"]
    assert json.loads((tmp_path / "s" / "results.json").read_text())["soak"]["steps"] == 200


class _Raises270Lines:
    name = "broken"

    def run(self, inputs, timer):  # what torch.compile's failure looked like: ~270 lines
        raise RuntimeError("compile failed\n" + "  File trace line\n" * 270)


@pytest.mark.parametrize("vs", ["lerobot", "off", "broken"])
def test_a_failing_vs_side_exits_non_zero_with_one_line(app, tmp_path, profile_file, fake_name, vs):
    from support.bench_fakes import FakeImpl

    register_fake(fake_name, refs={"off": FakeImpl(name="off", offset=1.0), "broken": _Raises270Lines()})
    res = CliRunner().invoke(app, ["bench", fake_name, "-p", profile_file, "--vs", vs, "--out",
                                   str(tmp_path / "run"), "--no-progress", "--no-plot"])
    assert res.exit_code == 4, res.output
    assert (tmp_path / "run" / "results.json").is_file()
    lines = [ln for ln in res.stderr.splitlines() if f"--vs {vs}" in ln]
    assert len(lines) == 1 and "trace line" not in res.stderr, res.stderr
    assert _last_json(res.stdout)["vs_status"] in ("unavailable", "gated-out", "error")


def test_trace_out_is_a_chrome_trace_of_the_stages(app, tmp_path, profile_file, fake_name):
    register_fake(fake_name)
    path = tmp_path / "trace.json"
    res = CliRunner().invoke(app, ["bench", fake_name, "-p", profile_file, "--vs", "eager", "--out",
                                   str(tmp_path / "run"), "--no-progress", "--no-plot",
                                   "--trace-out", str(path)])
    assert res.exit_code == 0, res.output
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"validate", "replay"}
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] in (1, 2) for e in spans)
    assert sum(e["name"] == "replay" and e["pid"] == 1 for e in spans) == 5       # iters of the profile
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert len(names) == 2
    files = json.loads((tmp_path / "run" / "results.json").read_text())["files"]
    assert files["chrome_trace"] == str(path) and files["chrome_trace_source"].startswith("stage timers")


@pytest.fixture
def pi05_without_tokenizer(tmp_path, monkeypatch):
    """A tiny Pi0.5 checkpoint whose tokenizer.model lives elsewhere (as a real download's does)."""
    from flashrt.testing.synthetic.pi0 import TINY, SyntheticSpec, write_checkpoint

    folder = tmp_path / "ck"
    write_checkpoint(folder, SyntheticSpec("pi05", TINY, ("top", "wrist")))
    tokenizer = (folder / "tokenizer.model").rename(tmp_path / "paligemma.model")
    monkeypatch.setattr("flashrt.frontends.pi0.tokenizer.hub_file", lambda *a, **k: None)  # no hub cache
    return folder, tokenizer


def test_tokenizer_flag_loads_a_checkpoint_without_one(app, tmp_path, profile_file, pi05_without_tokenizer):
    folder, tokenizer = pi05_without_tokenizer
    common = ["-p", profile_file, "--checkpoint", str(folder), "--no-plot"]
    res = CliRunner().invoke(app, ["bench", "pi05", *common, "--out", str(tmp_path / "no"), "--no-progress"])
    assert res.exit_code == 2 and "--tokenizer PATH" in res.stderr, res.output
    res = CliRunner().invoke(app, ["bench", "pi05", *common, "--tokenizer", str(tokenizer), "--out",
                                   str(tmp_path / "b"), "--no-progress"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "b" / "results.json").read_text())
    assert data["profile"]["model"]["tokenizer"] == str(tokenizer) and data["steady"]["iters"] == 5
    res = CliRunner().invoke(app, ["loop", "pi05", *common, "--tokenizer", str(tokenizer), "--steps", "4",
                                   "--rate", "50", "--out", str(tmp_path / "l")])
    assert res.exit_code == 0 and _last_json(res.stdout)["executed"] >= 1, res.output


def test_snac_noise_flag_reaches_the_snac_benchmark(app, tmp_path, profile_file):
    args = ["-p", profile_file, "--snac-noise", "seeded", "--no-progress", "--no-plot"]
    res = CliRunner().invoke(app, ["bench", "snac", *args, "--vs", "eager", "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "s" / "results.json").read_text())
    assert record["profile"]["model"]["noise_mode"] == "seeded"
    res = CliRunner().invoke(app, ["bench", "snac", *args, "--vs", "snac", "--out", str(tmp_path / "p")])
    assert res.exit_code == 4 and "unseeded noise" in res.stderr, res.output
    res = CliRunner().invoke(app, ["bench", "hifigan", *args, "--out", str(tmp_path / "h")])
    assert res.exit_code == 2 and "SNAC option" in res.stderr, res.output


def _no_matplotlib(*args, **kwargs):
    raise ImportError("No module named 'matplotlib'")


@pytest.mark.parametrize("command", ["loop", "soak"])
def test_loop_and_soak_keep_their_results_without_matplotlib(app, tmp_path, profile_file, fake_name,
                                                             monkeypatch, command):
    monkeypatch.setattr("flashrt.profile.plots.plot_panels", _no_matplotlib)
    register_fake(fake_name)
    extra = ["--steps", "20", "--rate", "500"] if command == "loop" else ["--no-progress"]
    out = tmp_path / command
    res = CliRunner().invoke(app, [command, fake_name, "-p", profile_file, "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    assert "figure skipped" in res.stderr and "matplotlib" in res.stderr
    data = json.loads((out / "results.json").read_text())
    assert "png" not in data["files"] and "matplotlib" in data["files"]["png_skipped"]
    assert not (out / f"{command}.png").exists() and _last_json(res.stdout)["kind"] == command


def test_soak_raw_samples_round_trip_to_the_reported_percentiles(app, tmp_path, profile_file, fake_name):
    from flashrt.profile.stats import LatencyStats

    register_fake(fake_name)
    out = tmp_path / "s"
    res = CliRunner().invoke(app, ["soak", fake_name, "-p", profile_file, "--out", str(out), "--no-progress",
                                   "--no-plot"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "results.json").read_text())
    raw = json.loads((out / "samples.json").read_text())
    assert data["files"]["samples"] == str(out / "samples.json") and "per_step_ms" not in data["soak"]
    assert len(raw["per_step_ms"]) == 200
    again = LatencyStats.from_samples([x for x in raw["per_step_ms"] if x is not None])
    for key in ("p50", "p90", "p99", "max"):
        assert getattr(again, key) == data["soak"]["latency"][key], key
    assert raw["worst"]["ms"] == data["soak"]["latency"]["max"] == max(raw["per_step_ms"])


def test_loop_trace_out_is_a_chrome_trace_of_every_step(app, tmp_path, profile_file, fake_name):
    register_fake(fake_name)
    path = tmp_path / "loop-trace.json"
    res = CliRunner().invoke(app, ["loop", fake_name, "-p", profile_file, "--steps", "12", "--rate", "200",
                                   "--out", str(tmp_path / "l"), "--no-plot", "--trace-out", str(path)])
    assert res.exit_code == 0, res.output
    events = json.loads(path.read_text())["traceEvents"]
    record = json.loads((tmp_path / "l" / "results.json").read_text())
    steps = [e for e in events if e["ph"] == "X"]
    assert record["files"]["chrome_trace"] == str(path)
    assert [e["args"]["tick"] for e in steps] == record["ticks"]["index"]
    assert all(e["name"] == "step" and e["pid"] == 1 and e["dur"] >= 0 for e in steps)
    for e, start, done in zip(steps, record["ticks"]["start_ms"], record["ticks"]["done_ms"]):
        assert e["ts"] == pytest.approx(start * 1e3) and e["dur"] == pytest.approx((done - start) * 1e3)
    assert sum(e["ph"] == "i" and e["name"] == "frame" for e in events) == len(steps)
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == ["flashrt loop"]
