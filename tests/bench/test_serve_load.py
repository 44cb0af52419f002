"""`flashrt bench serve` (flashrt/bench/serve.py, serve_load.py): the arrival schedule, the accounting
over the full denominator, and a small end-to-end run against an in-process server (a toy voice)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from flashrt.bench.serve_load import (  # noqa: E402
    Arrival,
    Outcome,
    parse_trace,
    playback_stalls,
    poisson_arrivals,
    poisson_schedule,
    summarize,
)
from flashrt.errors import CheckpointError, ConfigError  # noqa: E402
from flashrt.frontends.registry import TtsFamily, register_tts_family, unregister_tts_family  # noqa: E402


def test_the_poisson_schedule_is_seeded_increasing_and_at_its_rate():
    a, b = poisson_schedule(4.0, 2000, seed=3), poisson_schedule(4.0, 2000, seed=3)
    assert a == b and len(a) == 2000 and all(x < y for x, y in zip(a, a[1:]))
    assert poisson_schedule(4.0, 10, seed=4) != a[:10]
    assert 3.6 < len(a) / a[-1] < 4.4  # 2000 arrivals: the mean rate is within 10 % of 4/s
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 3, seed=0)
    with pytest.raises(ValueError):
        poisson_schedule(float("inf"), 3, seed=0)


def test_poisson_arrivals_mark_every_nth_client():
    arrivals = poisson_arrivals(2.0, 12, seed=1, texts=("a", "b"), hang_up_every=3, slow_every=4)
    assert [a.t for a in arrivals] == poisson_schedule(2.0, 12, seed=1)
    assert [a.text for a in arrivals[:3]] == ["a", "b", "a"]
    assert [i for i, a in enumerate(arrivals) if a.slow] == [3, 7, 11]
    assert [i for i, a in enumerate(arrivals) if a.hang_up] == [2, 5, 8]  # 11 is slow, not both


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
    assert len(level.requests) == 9 and level.requests[3]["code"] == "server_busy"


def test_slow_unsent_and_own_deadlines_in_the_accounting():
    outcomes = [
        _served(0, 150.0),                                             # late for the level's 100 ms
        Outcome(1, 0.0, status=200, ttfa_ms=150.0, total_ms=300.0, audio_s=1.0, deadline_ms=200.0),  # on time
        Outcome(2, 0.0, status=200, ttfa_ms=60.0, total_ms=90.0, audio_s=1.0, deadline_ms=50.0),     # late
        Outcome(3, 0.0, status=200, error="slow"),
        Outcome(4, 9.0, error="unsent"),
        Outcome(5, 0.0, error="cancelled"),                              # hung up before any response
        Outcome(6, 0.0, status=503, code="server_busy"),
    ]
    level = summarize(1.0, 1.0, outcomes, deadline_ms=100.0)
    assert (level.served, level.on_time, level.slow, level.unsent, level.cancelled) == (3, 1, 1, 1, 1)
    assert level.goodput == pytest.approx(1 / 4)  # 3 served + 1 refused are counted; 3 are apart
    accounted = (level.served + sum(level.refused.values()) + level.errors + level.timeouts + level.cancelled
                 + level.slow + level.unsent)
    assert accounted == level.offered == 7


def _write(tmp_path, text):
    path = tmp_path / "trace.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_playback_runs_dry_only_when_the_bytes_come_after_the_audio_before_them_ends():
    # 100 bytes a second: each 100-byte chunk plays for 1 s from when playback reaches it
    assert playback_stalls([(0.0, 100), (0.5, 100), (1.9, 100)], 100.0) == (0.0, 0)
    ms, n = playback_stalls([(0.0, 100), (1.5, 100), (2.0, 100)], 100.0)  # dry 1.0-1.5, then in time
    assert n == 1 and ms == pytest.approx(500.0)
    ms, n = playback_stalls([(0.0, 100), (1.5, 100), (3.0, 100)], 100.0)  # the stall delays the next end
    assert n == 2 and ms == pytest.approx(1000.0)
    ms, n = playback_stalls([(5.0, 50), (5.2, 50), (6.1, 100)], 100.0)  # starts at the first byte: 5.0
    assert n == 1 and ms == pytest.approx(100.0)
    assert playback_stalls([], 100.0) == (0.0, 0) and playback_stalls([(2.0, 10)], 100.0) == (0.0, 0)
    with pytest.raises(ValueError):
        playback_stalls([(0.0, 1)], 0.0)


def test_stalls_are_counted_over_the_served_apart_from_goodput():
    stalled = Outcome(0, 0.0, status=200, ttfa_ms=50.0, total_ms=900.0, audio_s=0.5, stall_ms=300.0, stalls=2)
    smooth = Outcome(1, 0.0, status=200, ttfa_ms=50.0, total_ms=300.0, audio_s=1.0, stall_ms=0.0)
    cut = Outcome(2, 0.0, status=200, ttfa_ms=50.0, error="cancelled")
    level = summarize(1.0, 1.0, [stalled, smooth, cut], deadline_ms=100.0)
    assert level.goodput == 1.0 and level.stalled == 1
    assert level.stall_ms["count"] == 2 and level.stall_ms["max"] == 300.0


def test_a_trace_is_parsed_and_sorted(tmp_path):
    path = _write(tmp_path, '{"t": 0.5, "text": "b", "deadline_ms": 300}\n\n'
                            '{"t": 0, "text": "a", "cancel_s": 1.5}\n')
    assert parse_trace(path) == [Arrival(0.0, "a", None, 1.5), Arrival(0.5, "b", 300.0, None)]


@pytest.mark.parametrize("line, words", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"t": 0, "text": "a", "speed": 2}', "unknown keys ['speed']"),
    ('{"t": 0}', "'text'"),
    ('{"t": 0, "text": "  "}', "'text'"),
    ('{"text": "a"}', "'t' must be a finite number"),
    ('{"t": -1, "text": "a"}', "'t' must be >= 0"),
    ('{"t": true, "text": "a"}', "'t' must be a finite number"),
    ('{"t": 0, "text": "a", "deadline_ms": 0}', "'deadline_ms' must be > 0"),
    ('{"t": 0, "text": "a", "deadline_ms": NaN}', "'deadline_ms' must be a finite number"),
    ('{"t": 0, "text": "a", "cancel_s": "1"}', "'cancel_s' must be a finite number"),
])
def test_a_bad_trace_line_is_one_error_naming_it(tmp_path, line, words):
    path = _write(tmp_path, '{"t": 0, "text": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as info:
        parse_trace(path)
    message = str(info.value)
    assert f"{path}, line 2: " in message and words in message and "\n" not in message


def test_an_empty_or_missing_trace_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no requests"):
        parse_trace(_write(tmp_path, "\n  \n"))
    with pytest.raises(ConfigError, match="cannot read"):
        parse_trace(tmp_path / "absent.jsonl")


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


_FIELDS = ("served", "refused", "errors", "timeouts", "cancelled", "slow", "unsent")


def _category(r):
    """The one bucket of a request record (an independent reading of `summarize`'s rules)."""
    if r["status"] == 200 and r["error"] is None and r["total_ms"] is not None:
        return "served"
    if r["error"] in ("cancelled", "slow", "unsent", "timeout"):
        return {"timeout": "timeouts"}.get(r["error"], r["error"])
    return "refused" if r["status"] in (429, 503) else "errors"


def _check_accounting(levels, offered):
    for lv in levels:
        records = lv["requests"]
        assert lv["offered"] == offered == len(records)
        assert [r["index"] for r in records] == list(range(offered))
        counts = {k: lv[k] if k != "refused" else sum(lv["refused"].values()) for k in _FIELDS}
        assert sum(counts.values()) == offered, lv
        assert counts == {k: sum(1 for r in records if _category(r) == k) for k in _FIELDS}, lv
        assert all(r["lag_ms"] is not None for r in records)


def _run(args, capsys):
    from flashrt.cli import main

    code = main(["bench", "serve", "--voice", "toyvoice", "--warm", "2", "--no-plot", "--timeout", "30",
                 "--level-cap", "60", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def test_an_end_to_end_run_accounts_for_every_request(toy, tmp_path, capsys):
    code, line, err = _run(["--loads", "1,3", "--requests", "6", "--compare-admission", "--cancel-every", "3",
                            "--slow-consumer", "4", "--slow-hold", "0.2", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert line["bench"] == "serve" and line["loads"] == [1.0, 3.0] and set(line["goodput"]) == {"off", "on"}
    assert line["status"] == "ok" and line["trace"] is False and line["results"].endswith("results.json")
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["capacity_rps"] > 0 and record["deadline_ms"] > 0
    assert record["single_stream"]["cold"]["status"] == 200 and len(record["single_stream"]["warm"]) == 2
    assert record["heap"]["frozen"] > 0  # the in-process server settled its heap once the voice loaded
    for levels in record["modes"].values():
        assert [lv["load"] for lv in levels] == [1.0, 3.0]
        _check_accounting(levels, 6)
        for lv in levels:
            assert lv["cancelled"] == 2 and lv["slow"] == 1 and lv["errors"] == 0 and lv["timeouts"] == 0
            assert all(r["stall_ms"] is not None for r in lv["requests"] if _category(r) == "served")
            assert lv["server"]["outcomes"].get("done", 0) >= lv["served"]  # this level's, not cumulative
            assert sum(lv["server"]["outcomes"].values()) <= 6 and "speech" in lv["server"]["stages"]
    assert "admission on" in err and "goodput deadline" in err


def test_a_frozen_trace_is_replayed_with_its_deadlines_and_cancels(toy, tmp_path, capsys):
    trace = _write(tmp_path, "".join(json.dumps(item) + "\n" for item in [
        {"t": 0.0, "text": "one"}, {"t": 0.05, "text": "two", "cancel_s": 0},
        {"t": 0.1, "text": "three", "deadline_ms": 1e-6}, {"t": 0.15, "text": "four"}]))
    code, line, err = _run(["--trace", str(trace), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert line["trace"] is True and len(line["loads"]) == 1 and line["loads"][0] > 0
    (level,) = json.loads((tmp_path / "out" / "results.json").read_text())["modes"]["off"]
    _check_accounting([level], 4)
    assert level["cancelled"] == 1 and level["requests"][1]["error"] == "cancelled"
    assert level["requests"][2]["deadline_ms"] == 1e-6 and level["on_time"] <= level["served"] - 1


def test_a_bad_trace_is_one_line_and_the_json_line(tmp_path, capsys):
    from flashrt.cli import main

    trace = _write(tmp_path, '{"t": 0, "text": "a", "deadline": 3}\n')
    assert main(["bench", "serve", "--trace", str(trace), "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert "line 1: unknown keys ['deadline']" in err
    assert json.loads(out.strip().splitlines()[-1])["status"] == "error"
    assert not (tmp_path / "out").exists()


def test_bad_loads_are_one_line(capsys):
    from flashrt.cli import main

    assert main(["bench", "serve", "--loads", "0,2"]) == 2
    out, err = capsys.readouterr()
    assert "--loads" in err and json.loads(out.strip().splitlines()[-1])["status"] == "error"


@pytest.mark.parametrize("args", [["--slots", "0,8"], ["--slots", "x"], ["--slots", "2", "--url",
                                                                            "http://127.0.0.1:9"]])
def test_bad_slots_are_one_line(args, capsys):
    from flashrt.cli import main

    assert main(["bench", "serve", *args]) == 2
    out, err = capsys.readouterr()
    assert "--slots" in err and json.loads(out.strip().splitlines()[-1])["status"] == "error"


def test_slots_compared_share_capacity_and_name_their_modes():
    from flashrt.bench.serve import _merge

    first = _merge(None, {"capacity_rps": 2.0, "modes": {"off": [1]}}, 1, True)
    both = _merge(first, {"capacity_rps": 2.0, "modes": {"off": [2]}}, 8, True)
    assert both["modes"] == {"off, slots 1": [1], "off, slots 8": [2]} and both["slots"] == [1, 8]


class _Slow:
    sample_rate = 8000

    def stream(self, text, seed=None, speed=1.0):
        import time

        for _ in range(6):
            time.sleep(0.03)
            yield np.full(400, 0.1, dtype=np.float32)


@pytest.fixture
def slow_toy():
    def detect(source):
        if not str(source).startswith("slowtoy"):
            raise CheckpointError(f"{source}: not a slow toy voice")

    register_tts_family(TtsFamily("slow-toy-serve", detect, lambda source, **o: _Slow()))
    yield
    unregister_tts_family("slow-toy-serve")


class _Starving:
    """Chunks of 50 ms of audio, 120 ms apart: slower than playback, so every stream runs dry."""

    sample_rate = 8000

    def stream(self, text, seed=None, speed=1.0):
        import time

        for i in range(4):
            if i:
                time.sleep(0.12)
            yield np.full(400, 0.1, dtype=np.float32)


def test_a_voice_slower_than_playback_stalls_every_stream(tmp_path, capsys):
    def detect(source):
        if not str(source).startswith("starving"):
            raise CheckpointError(f"{source}: not a starving toy voice")

    register_tts_family(TtsFamily("starving-serve", detect, lambda source, **o: _Starving()))
    try:
        from flashrt.cli import main

        code = main(["bench", "serve", "--voice", "starving", "--warm", "1", "--no-plot", "--timeout", "20",
                     "--level-cap", "60", "--loads", "0.5", "--requests", "3", "--out", str(tmp_path)])
    finally:
        unregister_tts_family("starving-serve")
    out, err = capsys.readouterr()
    assert code == 0, err
    (level,) = json.loads((tmp_path / "results.json").read_text())["modes"]["off"]
    served = [r for r in level["requests"] if _category(r) == "served"]
    assert served and level["stalled"] == len(served)
    assert json.loads(out.strip().splitlines()[-1])["stalled"] == {"off": [len(served)]}
    # 0.2 s of audio whose last bytes are made 0.36 s after the first: playback runs dry at least once
    assert all(r["stalls"] >= 1 and r["stall_ms"] > 0 for r in served), served
    assert "stalled" in err


def test_a_restart_mid_level_cuts_what_is_in_flight_cleanly_and_serves_what_comes_after(slow_toy, tmp_path,
                                                                                         capsys):
    from flashrt.cli import main

    code = main(["bench", "serve", "--voice", "slowtoy", "--warm", "2", "--no-plot", "--timeout", "20",
                 "--level-cap", "60", "--loads", "2", "--requests", "16", "--restart-at", "0.6",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads((tmp_path / "results.json").read_text())
    (level,) = record["modes"]["off"]
    _check_accounting([level], 16)
    restart = level["restart"]
    assert restart["at_s"] == 0.6 and restart["down_ms"] > 0 and level["timeouts"] == 0
    assert restart["sent_after"] > 0 and restart["served_after"] == restart["sent_after"]
    assert level["server"]["restarted"] is True
    served = [r for r in level["requests"] if _category(r) == "served"]
    assert len({r["bytes"] for r in served}) == 1  # a stream cut by the restart is an error, never "served"
    # what the restart touched failed cleanly: refused (503 server_shutting_down) before its first audio,
    # a broken stream after it, or no connection while the server was down
    for r in level["requests"]:
        if _category(r) != "served":
            assert (r["status"], r["code"]) == (503, "server_shutting_down") or r["error"] in (
                "RemoteProtocolError", "ReadError", "ConnectError"), r


def test_restart_at_needs_the_in_process_server(capsys):
    from flashrt.cli import main

    assert main(["bench", "serve", "--restart-at", "1", "--url", "http://127.0.0.1:9"]) == 2
    out, err = capsys.readouterr()
    assert "--restart-at" in err and json.loads(out.strip().splitlines()[-1])["status"] == "error"


def test_a_given_capacity_and_deadline_set_the_offered_load(toy, tmp_path, capsys):
    """--capacity / --deadline-ms replace the measured ones: the same arrivals against any server."""
    code, line, err = _run(["--loads", "1,2", "--requests", "3", "--capacity", "5", "--deadline-ms", "900",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "results.json").read_text())
    assert (record["capacity_rps"], record["deadline_ms"]) == (5.0, 900.0)
    assert [lv["rate_per_s"] for lv in record["modes"]["off"]] == [5.0, 10.0]
    _check_accounting(record["modes"]["off"], 3)
    assert main_rejects(["--capacity", "0"], capsys)


def main_rejects(args, capsys):
    from flashrt.cli import main

    code = main(["bench", "serve", *args])
    out, err = capsys.readouterr()
    return code == 2 and "--capacity" in err and json.loads(out.strip().splitlines()[-1])["status"] == "error"
