"""bench/orpheus_streams.py (the GPU script's many-streams row) cannot rot: a tiny CPU run serves every
stream of every level, with no capture after load, and prints its JSON line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_serves_every_stream_and_prints_the_json_line():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "orpheus_streams.py"), "--device", "cpu",
                           "--preset", "tiny", "--streams", "1,3", "--frames", "3", "--budget-s", "60"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["status"] == "ok" and [lv["streams"] for lv in line["levels"]] == [1, 3]
    three = line["levels"][1]
    assert three["served"] == 3 and not three["recaptured"] and three["ttfa_ms_p99"] > 0
    assert 0 <= three["stalled"] <= 3 and three["stall_ms_p99"] >= three["stall_ms_p50"] >= 0
