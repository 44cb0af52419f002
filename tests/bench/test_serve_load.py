"""`flashrt bench serve` (flashrt/bench/serve.py, serve_load.py): the arrival schedule, the accounting
over the full denominator, and a small end-to-end run against an in-process server (a toy voice)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from flashrt.bench.serve_load import Outcome, poisson_schedule, summarize  # noqa: E402
from flashrt.errors import CheckpointError  # noqa: E402
from flashrt.frontends.registry import TtsFamily, register_tts_family, unregister_tts_family  # noqa: E402


def test_the_poisson_schedule_is_seeded_increasing_and_at_its_rate():
    a, b = poisson_schedule(4.0, 2000, seed=3), poisson_schedule(4.0, 2000, seed=3)
    assert a == b and len(a) == 2000 and all(x < y for x, y in zip(a, a[1:]))
    assert poisson_schedule(4.0, 10, seed=4) != a[:10]
    assert 3.6 < len(a) / a[-1] < 4.4  # 2000 arrivals: the mean rate is within 10 % of 4/s
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 3, seed=0)


def _served(i, ttfa, total=200.0, audio_s=1.0):
    return Outcome(i, 0.0, status=200, ttfa_ms=ttfa, total_ms=total, audio_s=audio_s)


def test_goodput_counts_every_offered_request():
    outcomes = [
        _served(0, 50.0), _served(1, 90.0), _served(2, 150.0),          # the last is served but late
        Outcome(3, 0.0, status=503, code="server_busy"),
        Outcome(4, 0.0, status=503, code="deadline_unmeetable"),
        Outcome(5, 0.0, status=500, code="server_error"),
        Outcome(6, 0.0, error="timeout"),
        Outcome(7, 0.0, error="ConnectError"),
        Outcome(8, 0.0, status=200, ttfa_ms=40.0, error="cancelled"),    # the client hung up on purpose
    ]
    level = summarize(2.0, 1.5, outcomes, deadline_ms=100.0)
    assert level.offered == 9 and level.served == 3 and level.on_time == 2 and level.cancelled == 1
    assert level.goodput == pytest.approx(2 / 8)
    assert level.refused == {"server_busy": 1, "deadline_unmeetable": 1}
    assert level.errors == 2 and level.timeouts == 1
    assert level.ttfa_ms["count"] == 3 and level.ttfa_ms["max"] == 150.0
    assert level.rtf["p50"] == pytest.approx(0.2)


class _Toy:
    sample_rate = 8000

    def stream(self, text, seed=None, speed=1.0):
        for _ in range(3):
            yield np.full(400, 0.1, dtype=np.float32)


@pytest.fixture
def toy():
    def detect(source):
        if not str(source).startswith("toy"):
            raise CheckpointError(f"{source}: not a toy voice")

    register_tts_family(TtsFamily("toy-serve", detect, lambda source, **o: _Toy()))
    yield
    unregister_tts_family("toy-serve")


def test_an_end_to_end_run_accounts_for_every_request(toy, tmp_path, capsys):
    from flashrt.cli import main

    code = main(["bench", "serve", "--voice", "toyvoice", "--loads", "1,3", "--requests", "6", "--warm", "2",
                 "--compare-admission", "--cancel-every", "3", "--out", str(tmp_path), "--no-plot",
                 "--timeout", "30", "--level-cap", "60"])
    out, err = capsys.readouterr()
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert line["bench"] == "serve" and line["loads"] == [1.0, 3.0] and set(line["goodput"]) == {"off", "on"}
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["capacity_rps"] > 0 and record["deadline_ms"] > 0
    for levels in record["modes"].values():
        assert [lv["load"] for lv in levels] == [1.0, 3.0]
        for lv in levels:
            refused = sum(lv["refused"].values())
            accounted = lv["served"] + refused + lv["errors"] + lv["timeouts"] + lv["cancelled"]
            assert lv["offered"] == 6 and accounted == 6, lv
            assert lv["cancelled"] == 2 and lv["errors"] == 0 and lv["timeouts"] == 0
            assert lv["server"]["outcomes"]["done"] >= lv["served"]
    assert "admission on" in err and "goodput deadline" in err


def test_bad_loads_are_one_line(capsys):
    from flashrt.cli import main

    assert main(["bench", "serve", "--loads", "0,2"]) == 2
    assert "--loads" in capsys.readouterr().err
