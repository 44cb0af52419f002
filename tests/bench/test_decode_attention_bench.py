"""bench/decode_attention.py cannot rot: its quick run times both forms of the op and of the slot block
and prints its JSON line (or says the op does not build here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashrt.ops import torch_cpu

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_times_both_forms_and_prints_the_json_line():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_attention.py"), "--quick"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    if not torch_cpu.loads():
        assert line["status"] == "unavailable"
        return
    assert line["status"] == "ok" and len(line["op"]) == 1 and [b["rows"] for b in line["block"]] == [2]
    for case in (*line["op"], *line["block"]):
        times = [v for k, v in case.items() if k.endswith(("_us", "_ms"))]
        assert len(times) == 2 and all(t > 0 for t in times)
        # speedup from the unrounded times; the printed times are rounded to 0.01
        assert case["speedup"] == pytest.approx(times[0] / times[1], abs=0.02)
