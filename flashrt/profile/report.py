"""Reports for people and for scripts: a rich table of stage statistics, JSON files and JSON lines.

`to_jsonable` turns dataclasses, numpy scalars/arrays, paths and non-finite floats (-> None) into
plain JSON values, so every report written by flashrt parses with any strict JSON reader.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from flashrt.profile.stats import LatencyStats

_COLUMNS = ("count", "failures", "mean", "p50", "p90", "p99", "max", "jitter", "miss_rate")


def to_jsonable(obj: Any) -> Any:
    """A strict-JSON version of `obj` (NaN/inf -> None, tuples -> lists, dataclasses -> dicts)."""
    if isinstance(obj, LatencyStats):
        return obj.to_dict()
    if is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    return _scalar(obj)


def _scalar(obj: Any) -> Any:
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return to_jsonable(obj.tolist())
    return str(obj)


def json_line(obj: Any) -> str:
    """One compact JSON line (no newline) for scripts."""
    return json.dumps(to_jsonable(obj), separators=(",", ":"), allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented strict JSON, atomically (temp file + rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
    with os.fdopen(fd, "w") as f:
        json.dump(to_jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if value != 0 and abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.1f}"


def stats_table(stats: Mapping[str, LatencyStats], title: str = "latency (ms)") -> Any:
    """A rich Table with one row per stage: count, failures, mean, p50/p90/p99/max, jitter, and the miss
    rate with the deadline it was counted against."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("stage")
    for column in _COLUMNS:
        table.add_column(column, justify="right")
    for name, s in stats.items():
        row = s.to_dict()
        table.add_row(name, *(_miss(row) if c == "miss_rate" else _fmt(row[c]) for c in _COLUMNS))
    return table


def _miss(row: Mapping[str, Any]) -> str:
    """A miss rate with the deadline it was counted against ("0.02 @ 50 ms"); "-" without a deadline."""
    if row.get("miss_rate") is None or row.get("deadline_ms") is None:
        return "-"
    return f"{_fmt(row['miss_rate'])} @ {row['deadline_ms']:g} ms"


def kv_table(rows: Mapping[str, Any], title: str) -> Any:
    """A two-column rich Table (key, value) for cold-start times, memory, roofline and the like."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("item")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(str(key), value if isinstance(value, str) else _fmt(value))
    return table


def print_tables(*tables: Any, console: Any = None) -> None:
    """Print rich tables to `console` (stderr by default, keeping stdout for the JSON line)."""
    from rich.console import Console

    if console is None:
        console = Console(stderr=True)
        console.width = max(console.width, 120)
    for table in tables:
        console.print(table)
