"""`flashrt calibrate`: a miss calibrates and stores, a hit says so; recorded data; a bad precision."""

import json

import numpy as np

from flashrt.cli import app, run_app
from flashrt.frontends.pi0.quantize import synthetic_observations
from flashrt.testing.synthetic.pi0 import TINY, SyntheticSpec, write_checkpoint


def test_calibrate_miss_then_hit(capsys, tmp_path):
    ck = tmp_path / "ck"
    write_checkpoint(ck, SyntheticSpec("pi05", TINY, ("top", "wrist")))
    argv = ["calibrate", str(ck), "--dir", str(tmp_path / "cache"), "--samples", "3", "--json"]
    assert run_app(app, argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["cache"] == "calibrated" and first["gate"]["passed"] is True
    assert run_app(app, argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "cache hit" in out and "no calibration pass" in out and first["entry"] in out


def test_calibrate_from_a_recorded_trace(capsys, tmp_path):
    import flashrt
    from flashrt.bench.trace import FrozenTrace

    ck = tmp_path / "ck"
    write_checkpoint(ck, SyntheticSpec("pi0", TINY, ("top", "wrist")))
    obs = synthetic_observations(flashrt.load_policy(ck).frontend, 6, seed=7)
    for o in obs:
        o["noise"] = o["noise"][None]  # the bench's (1, H, A) noise
        assert isinstance(o["images"]["top"], np.ndarray)
    trace = FrozenTrace.from_inputs(obs).save(tmp_path / "trace.pt")
    argv = ["calibrate", str(ck), "--dir", str(tmp_path / "cache"), "--samples", "4", "--data", str(trace),
            "--json"]
    assert run_app(app, argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cache"] == "calibrated"


def test_calibrate_refuses_a_float_precision(capsys, tmp_path):
    assert run_app(app, ["calibrate", str(tmp_path), "--precision", "bf16"]) == 2
    assert "--precision" in capsys.readouterr().err


def test_calibrate_takes_the_tokenizer_of_a_checkpoint_without_one(capsys, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    write_checkpoint(ck, SyntheticSpec("pi05", TINY, ("top", "wrist")))
    tokenizer = (ck / "tokenizer.model").rename(tmp_path / "paligemma.model")
    monkeypatch.setattr("flashrt.frontends.pi0.tokenizer.hub_file", lambda *a, **k: None)  # no hub cache
    argv = ["calibrate", str(ck), "--dir", str(tmp_path / "cache"), "--samples", "2", "--json"]
    assert run_app(app, argv) == 2
    assert "--tokenizer PATH" in capsys.readouterr().err
    assert run_app(app, [*argv, "--tokenizer", str(tokenizer)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cache"] == "calibrated"
