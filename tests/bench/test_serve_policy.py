"""`flashrt bench serve-policy` (flashrt/bench/serve_policy.py): a small run on the tiny Pi0.5 writes both
modes side by side after its quality gate (batched replies equal the requests served alone), with the
JSON line last; bad options are refused with one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("websockets")


def test_a_small_run_reports_both_modes_after_the_gate(tmp_path, capsys, one_thread):
    from flashrt.cli import main

    code = main(["bench", "serve-policy", "--profile", "cpu-tiny", "--robots", "2", "--requests", "2",
                 "--rounds", "1", "--batch-window-ms", "200", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert line["bench"] == "serve-policy" and line["status"] == "ok" and line["robots"] == 2
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["gate"]["passed"] and record["gate"]["max_abs_diff"] <= 1e-5
    assert record["gate"]["batch"] == 2 and record["batches"] == [1, 2]  # the gate round shared a replay
    for mode, served in (("batched", 4), ("one-at-a-time", 4)):
        r = record["modes"][mode]
        assert r["served"] == served and r["errors"] == 0 and r["latency_ms"]["count"] == served
    assert record["modes"]["one-at-a-time"]["mean_batch"] == 1.0
    assert set(record["modes"]["one-at-a-time"]["server_rounds"]) == {"1"}  # JSON keys
    assert "batched / one-at-a-time" in err


@pytest.mark.parametrize("args", [["--robots", "0"], ["--variant", "groot"], ["--profile", "nope"]])
def test_bad_options_are_refused(capsys, args):
    from flashrt.cli import main

    assert main(["bench", "serve-policy", *args]) == 2
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["status"] == "error"
