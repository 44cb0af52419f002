import json
import math
from pathlib import Path

import numpy as np

from flashrt.profile.report import json_line, kv_table, stats_table, to_jsonable, write_json
from flashrt.profile.stats import LatencyStats


def test_to_jsonable_is_strict_json(tmp_path):
    obj = {"a": float("nan"), "b": np.float32(1.5), "c": (1, 2), "p": Path("/x"),
           "s": LatencyStats.from_samples([1.0, 2.0]), "arr": np.arange(3)}
    out = to_jsonable(obj)
    assert out["a"] is None and out["b"] == 1.5 and out["c"] == [1, 2] and out["p"] == "/x"
    assert out["arr"] == [0, 1, 2] and out["s"]["p50"] == 1.5
    line = json_line(obj)
    assert "\n" not in line and json.loads(line) == out
    path = write_json(tmp_path / "r" / "x.json", obj)
    assert json.loads(path.read_text()) == out


def test_tables_render():
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(stats_table({"replay": LatencyStats.from_samples([1.0, 2.0, 3.0], 100)}))
    console.print(kv_table({"load_ms": 12.5, "nan": math.nan, "text": "ok"}, "cold"))
    console.print(stats_table({"free": LatencyStats.from_samples([1.0, 2.0])}))  # no rate: no deadline
    text = console.export_text()
    assert "replay" in text and "2.000" in text and "load_ms" in text
    assert "0 @ 10 ms" in text  # each miss rate says the deadline it was counted against (100 Hz)
