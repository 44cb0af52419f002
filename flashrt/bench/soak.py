"""`flashrt soak`: K steps in a row, watching memory growth and latency drift.

Every `sample_every` steps the resident set size (and CUDA allocated bytes) is sampled; after the
warm-up steps, a least-squares line through the samples gives the growth rate in MiB per 1000 steps.
Latency drift compares the median of the first and the last decile of the step latencies. A frontend
is flagged as leaking when its memory grows faster than `leak_mib_per_1k` AND by more than
`min_growth_mib` in total (allocator noise stays under both), and as drifting when the last-decile
median exceeds the first-decile median by more than `drift_ratio`. Failed steps are counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashrt.bench import memory
from flashrt.profile.stats import LatencyStats

MIB = 2**20


@dataclass(frozen=True)
class SoakConfig:
    steps: int = 10_000
    warmup: int | None = None  # None: min(100, steps // 10)
    sample_every: int = 10
    leak_mib_per_1k: float = 1.0
    min_growth_mib: float = 8.0
    drift_ratio: float = 1.5

    def __post_init__(self) -> None:
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(100, self.steps // 10))
        if self.steps < 20 or self.sample_every < 1 or self.warmup < 0 or self.warmup >= self.steps:
            raise ValueError(f"bad soak config {self}: need steps >= 20, 0 <= warmup < steps")


def slope_per_step(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope dy/dx (0 when fewer than 2 points or no spread in x)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def run_soak(step: Callable[[int], Any], config: SoakConfig, device: str = "cpu",
             progress: Any = None, rss: Callable[[], int] = memory.rss_bytes) -> dict[str, Any]:
    """Call `step(i)` for i in range(steps); returns the summary (see module doc). Latencies go into a
    preallocated array and samples are few, so the soak itself does not grow the RSS it measures.
    ``rss`` reads the resident bytes (the process's by default); the leak verdict depends on nothing else."""
    lat = np.full(config.steps, np.nan)
    n_samples = (config.steps - config.warmup + config.sample_every - 1) // config.sample_every
    samples = {"step": [0] * n_samples, "rss": [0] * n_samples, "cuda": [], "median_ms": [None] * n_samples,
               "max_ms": [None] * n_samples}
    previous, s = 0, 0
    for i in range(config.steps):
        start = time.perf_counter_ns()
        try:
            step(i)
            lat[i] = (time.perf_counter_ns() - start) / 1e6
        except Exception:
            pass  # stays NaN: counted as a failure
        if i >= config.warmup and (i - config.warmup) % config.sample_every == 0:
            _sample(samples, s, i, device, lat[previous:i + 1], rss)
            previous, s = i + 1, s + 1
        if progress is not None:
            progress.update(1)
    ok = lat[~np.isnan(lat)]
    summary = summarize_soak(ok.tolist(), int(np.isnan(lat).sum()), samples, config)
    worst = int(np.nanargmax(lat)) if ok.size else None
    summary["worst"] = {"step": worst, "ms": None if worst is None else float(lat[worst])}
    summary["per_step_ms"] = [None if np.isnan(x) else float(x) for x in lat]  # raw: null = failed step
    return summary


def _sample(samples: dict[str, list], s: int, i: int, device: str, window: np.ndarray,
            rss: Callable[[], int]) -> None:
    samples["step"][s] = i
    samples["rss"][s] = rss()
    window = window[~np.isnan(window)]
    samples["median_ms"][s] = float(np.median(window)) if window.size else None
    samples["max_ms"][s] = float(window.max()) if window.size else None
    cuda = memory.cuda_memory(device)
    if cuda is not None:
        samples["cuda"].append(cuda["allocated"])


def _growth(steps: list[int], values: list[int], config: SoakConfig) -> dict[str, Any]:
    if not values:
        return {"start_mib": None, "end_mib": None, "growth_mib": None, "mib_per_1k_steps": None,
                "leak": False}
    rate = slope_per_step(list(map(float, steps)), [v / MIB for v in values]) * 1000
    growth = (values[-1] - values[0]) / MIB
    return {"start_mib": values[0] / MIB, "end_mib": values[-1] / MIB, "growth_mib": growth,
            "mib_per_1k_steps": rate,
            "leak": rate > config.leak_mib_per_1k and growth > config.min_growth_mib}


def summarize_soak(lat: list[float], failures: int, samples: dict[str, list],
                   config: SoakConfig) -> dict[str, Any]:
    """Memory growth, latency drift and flags from the raw soak data."""
    decile = max(1, len(lat) // 10)
    first = statistics.median(lat[:decile]) if lat else None
    last = statistics.median(lat[-decile:]) if lat else None
    drift = last / first if first else None
    rss = _growth(samples["step"], samples["rss"], config)
    cuda = _growth(samples["step"], samples["cuda"], config) if samples["cuda"] else None
    return {"config": config, "steps": config.steps, "failures": failures,
            "latency": LatencyStats.from_samples(lat, failures=failures),
            "drift": {"first_decile_median_ms": first, "last_decile_median_ms": last, "ratio": drift,
                      "flagged": drift is not None and drift > config.drift_ratio},
            "rss": rss, "cuda_allocated": cuda,
            "leak": bool(rss["leak"] or (cuda and cuda["leak"])),
            "samples": {"step": samples["step"], "rss_mib": [v / MIB for v in samples["rss"]],
                        "median_ms": samples["median_ms"], "max_ms": samples.get("max_ms", [])}}


def run_soak_benchmark(name: str, profile: Any, config: SoakConfig, checkpoint: str | None = None,
                       progress: bool = True) -> dict[str, Any]:
    """Run benchmark `name`'s hot path `config.steps` times over its frozen trace."""
    from tqdm import tqdm

    from flashrt.bench.env import environment
    from flashrt.bench.harness import BenchOptions, build_adapter, freeze_trace, torch_threads
    from flashrt.bench.profiles import check_device
    from flashrt.profile.timers import StageTimer

    device, cold = check_device(profile), {}
    with torch_threads(profile.device.threads):
        adapter = build_adapter(name, profile, BenchOptions(checkpoint=checkpoint), device, cold)
        trace = freeze_trace(adapter, profile, None)
        timer = StageTimer(device, nvtx=False)

        def step(i: int) -> None:
            adapter.run(trace[i], timer)
            timer.reset()

        with tqdm(total=config.steps, desc=f"soak {name}", disable=not progress, leave=False) as bar:
            summary = run_soak(step, config, device, bar)
    return {"schema": "flashrt.soak.result/1", "kind": "soak", "benchmark": name,
            "status": "leak" if summary["leak"] else "ok", "profile": profile.to_dict(),
            "trace": trace.record(), "cold_start_ms": cold, "soak": summary, "env": environment()}


def soak_tables(record: dict[str, Any], console: Any = None) -> None:
    """Tables for people: memory growth, latency drift, flags."""
    from flashrt.profile.report import kv_table, print_tables, stats_table

    s = record["soak"]
    rows = {"steps": s["steps"], "failures": s["failures"], "leak flagged": str(s["leak"]),
            **{f"rss {k}": v for k, v in s["rss"].items()},
            **{f"drift {k}": v if not isinstance(v, bool) else str(v) for k, v in s["drift"].items()}}
    print_tables(kv_table(rows, f"soak {record['benchmark']}"),
                 stats_table({"step": s["latency"]}, "soak (ms)"), console=console)


def soak_figure(record: dict[str, Any], path: Any) -> Any:
    """RSS over the run, and the step latency: median AND max of each sampling window, and the worst
    call of the whole run marked (a median-only line hid an outlier step)."""
    from flashrt.profile.plots import plot_panels

    return plot_panels(path, soak_panels(record), f"flashrt soak · {record['benchmark']}")


def soak_panels(record: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any], dict[str, float]]]:
    """The soak figure's panels (`flashrt.profile.plots.plot_panels`)."""
    s, worst = record["soak"]["samples"], record["soak"].get("worst") or {}
    keep = lambda key: ([x for x, m in zip(s["step"], s[key]) if m is not None],
                        [m for m in s[key] if m is not None])
    latency = {"median": keep("median_ms"), "max": keep("max_ms")}
    if worst.get("step") is not None:
        latency[f"worst call ({worst['ms']:.1f} ms)"] = ([worst["step"]], [worst["ms"]], "x")
    return [("resident set size", "step", "MiB", {"rss": (s["step"], s["rss_mib"])}, {}),
            ("step latency (median and max since the previous sample)", "step", "ms", latency, {})]
