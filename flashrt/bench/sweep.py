"""`flashrt bench NAME --sweep`: flashrt against a second implementation at every length of a sweep.

Regime: one call per length (batch 1), the input of each length drawn once (seeded) and given to both
sides. Per length: both outputs compared first (max |delta|, gated at the profile's ``quality.atol``),
one warm-up call each, then ``pairs`` interleaved timed pairs (flashrt, reference, flashrt, ...; wall
time of `run`); reported: each side's median ms and the median of the per-pair ratios
reference / flashrt, so load on a shared machine hits both sides alike. A bucket boundary cannot hide:
every length is a call a user makes. On a CPU device each call's process CPU time is taken too
(``cpu_ratio``, same pairing): on a machine shared with other jobs the wall time of a call includes the
time slices other processes got while it ran, which the CPU time does not, so the CPU-time ratio is
the steadier measure of the work itself (both are reported; on a GPU only wall time means anything).

An adapter is sweepable when it answers `sweep_lengths() -> list[int]` (its default sweep),
`sweep_ready(lengths)` (make every length decodable, e.g. buffers for the longest) and
`inputs_at(length, seed) -> inputs` (what `run` takes); with `stream_delta(inputs) -> float` each row
also says how far streaming the same input lies from its one-shot output. Output: a table on stderr,
``sweep.png`` (ms vs length, both sides) and ``results.json`` in the output folder, one JSON line last
on stdout.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashrt.bench.harness import BenchOptions, build_adapter, torch_threads
from flashrt.bench.profiles import Profile, check_device
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer

__all__ = ["run_sweep", "parse_lengths", "plot_sweep"]

SCHEMA = "flashrt.sweep.result/1"


def parse_lengths(text: str | None) -> list[int] | None:
    """"auto" / "" -> None (the adapter's default sweep); "50,100,200" -> [50, 100, 200]."""
    if text is None or text.strip() in ("", "auto"):
        return None
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--sweep {text!r}: expected 'auto' or comma-separated frame counts") from None
    if not lengths or lengths[0] <= 0:
        raise ConfigError(f"--sweep {text!r}: frame counts must be positive")
    return lengths


def _max_delta(a: Any, b: Any) -> float:
    import torch

    a, b = (x["audio"] if isinstance(x, dict) else x for x in (a, b))
    a, b = torch.as_tensor(a).flatten().float(), torch.as_tensor(b).flatten().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def _timed(impl: Any, inputs: Any) -> tuple[float, float, Any]:
    """(wall ms, process CPU ms, output) of one call."""
    timer = StageTimer("cpu", nvtx=False)
    start, cpu = time.perf_counter(), time.process_time()
    out = impl.run(inputs, timer)
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3, out


def _paired(prefix: str, a: list[float], b: list[float]) -> dict[str, Any]:
    """Medians of both sides and of the per-pair ratios b / a, with their range."""
    ratios = [y / x for x, y in zip(a, b) if x > 0]
    if not ratios:
        return {}
    return {f"flashrt_{prefix}ms": statistics.median(a), f"reference_{prefix}ms": statistics.median(b),
            f"{prefix}ratio": statistics.median(ratios), f"{prefix}ratio_range": (min(ratios), max(ratios))}


def _point(adapter: Any, reference: Any, length: int, pairs: int, seed: int, atol: float,
           cpu_time: bool = False) -> dict[str, Any]:
    inputs = adapter.inputs_at(length, seed)
    ours, theirs = _timed(adapter, inputs)[-1], _timed(reference, inputs)[-1]
    delta = _max_delta(ours, theirs)
    row: dict[str, Any] = {"length": length, "max_abs_delta": delta, "gate": delta <= atol}
    if hasattr(adapter, "stream_delta"):                 # streaming of the same input vs its one-shot call
        row["stream_max_abs_delta"] = adapter.stream_delta(inputs)
    if not row["gate"]:
        return row
    a, b = [], []
    for _ in range(pairs):
        a.append(_timed(adapter, inputs)[:2])
        b.append(_timed(reference, inputs)[:2])
    row.update(_paired("", [x[0] for x in a], [x[0] for x in b]))
    if cpu_time:
        row.update(_paired("cpu_", [x[1] for x in a], [x[1] for x in b]))
    return row


def run_sweep(name: str, profile: Profile, options: BenchOptions, lengths: Sequence[int] | None = None,
              pairs: int = 5) -> dict[str, Any]:
    """The sweep record (module docstring); ConfigError when the adapter cannot sweep."""
    if pairs <= 0:
        raise ConfigError(f"--pairs {pairs}: must be positive")
    device, cold = check_device(profile), {}
    with torch_threads(profile.device.threads):
        adapter = build_adapter(name, profile, options, device, cold)
        try:
            return _sweep(name, adapter, profile, options, lengths, pairs)
        finally:
            if hasattr(adapter, "close"):
                adapter.close()


def _sweep(name: str, adapter: Any, profile: Profile, options: BenchOptions, lengths: Sequence[int] | None,
           pairs: int) -> dict[str, Any]:
    if not all(hasattr(adapter, m) for m in ("sweep_lengths", "sweep_ready", "inputs_at")):
        raise ConfigError(f"benchmark {name!r} has no length sweep (its adapter lacks inputs_at)")
    lengths = list(lengths or adapter.sweep_lengths())
    adapter.sweep_ready(lengths)
    vs = options.vs or getattr(adapter, "default_sweep_reference", "eager")
    reference = adapter.reference(vs)
    cpu_time = profile.device.kind == "cpu"
    rows = [_point(adapter, reference, n, pairs, profile.bench.seed, profile.quality.atol, cpu_time)
            for n in lengths]
    timed = [r for r in rows if "ratio" in r]
    status = "ok" if len(timed) == len(rows) else "gated-out"
    worst = min((r["ratio"] for r in timed), default=None)
    line = {"bench": "sweep", "benchmark": name, "vs": vs, "status": status, "lengths": lengths,
            "ratios": [round(r.get("ratio", 0.0), 3) for r in rows], "min_ratio": worst}
    if cpu_time:
        line["cpu_ratios"] = [round(r.get("cpu_ratio", 0.0), 3) for r in rows]
    profile_info = {"name": profile.name, "precision": profile.precision, "threads": profile.device.threads}
    return {"schema": SCHEMA, "kind": "sweep", "benchmark": name, "status": status, "profile": profile_info,
            "flashrt": adapter.name, "reference": getattr(reference, "name", vs), "pairs": pairs,
            "rows": rows, "min_ratio": worst, "line": line}


def render_sweep(record: dict[str, Any]) -> None:
    """The sweep as a table on stderr."""
    from flashrt.profile.report import kv_table, print_tables

    rows = {str(r["length"]): _row_text(r) for r in record["rows"]}
    print_tables(kv_table(rows, f"{record['benchmark']}: flashrt / {record['reference']} by length "
                                f"(median of {record['pairs']} pairs)"))


def _row_text(r: dict[str, Any]) -> str:
    delta = f"|d| {r['max_abs_delta']:.1e}"
    if "ratio" not in r:
        return f"GATED OUT {delta}"
    low, high = r["ratio_range"]
    stream = f"  stream |d| {r['stream_max_abs_delta']:.1e}" if "stream_max_abs_delta" in r else ""
    cpu = ""
    if "cpu_ratio" in r:
        c_low, c_high = r["cpu_ratio_range"]
        cpu = f"  cpu x{r['cpu_ratio']:.2f} ({c_low:.2f}-{c_high:.2f})"
    return (f"{r['flashrt_ms']:.1f} / {r['reference_ms']:.1f} ms  x{r['ratio']:.2f} ({low:.2f}-{high:.2f})"
            f"{cpu}  {delta}{stream}")


def plot_sweep(path: str | Path, record: dict[str, Any]) -> Path:
    """ms vs length, both sides (and the ratio on a second axis)."""
    from flashrt.profile.plots import _pyplot

    plt = _pyplot()
    rows = [r for r in record["rows"] if "ratio" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["length"] for r in rows]
    ax.plot(x, [r["flashrt_ms"] for r in rows], "o-", label=record["flashrt"])
    ax.plot(x, [r["reference_ms"] for r in rows], "s-", label=record["reference"])
    ax.set_xlabel("frames per call")
    ax.set_ylabel("ms per call (median)")
    ax.legend(loc="upper left")
    twin = ax.twinx()
    twin.plot(x, [r["ratio"] for r in rows], "k:", label="ratio")
    twin.set_ylabel("reference / flashrt")
    ax.set_title(f"{record['benchmark']}: latency by length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
