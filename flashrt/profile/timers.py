"""Per-stage timers: CUDA events on a CUDA device, `time.perf_counter_ns` on the CPU.

    timer = StageTimer(device)            # "cpu", "cuda", "cuda:1" or a torch.device
    for obs in trace:
        timer.new_call()                  # groups the stages of one call (optional)
        with timer.stage("validate"): ...
        with timer.stage("replay"): ...
    timer.stats(rate_hz=50)               # {stage: LatencyStats}

Each stage is also an NVTX range (`nvtx_range`), so Nsight timelines carry the same names. On CUDA
the events are only read (and the device synchronized) when results are asked for, never inside the
timed loop; the host clock is recorded as well so host-side stages can be read either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flashrt.profile.nvtx import nvtx_range
from flashrt.profile.stats import LatencyStats


@dataclass(frozen=True)
class StageRecord:
    """One timed stage of one call; times in ms since the timer's origin (device clock on CUDA)."""

    call: int
    stage: str
    start_ms: float
    end_ms: float
    host_start_ms: float
    host_end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


def _is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


class _HostClock:
    """perf_counter_ns marks; a mark is an int of nanoseconds."""

    def mark(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ms(self, a: int, b: int) -> float:
        return (b - a) / 1e6


class _CudaClock:
    """CUDA event marks recorded on the current stream; read after a synchronize."""

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self._device = torch.device(device)

    def mark(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        with self._torch.cuda.device(self._device):
            event.record()
        return event

    def elapsed_ms(self, a: Any, b: Any) -> float:
        b.synchronize()
        return float(a.elapsed_time(b))


class StageTimer:
    """Collects named stage timings, grouped into calls (see module docstring)."""

    def __init__(self, device: Any = "cpu", nvtx: bool = True):
        self.device = str(device)
        self.nvtx = nvtx
        self._clock = _CudaClock(device) if _is_cuda(device) else _HostClock()
        self._raw: list[tuple[int, str, Any, Any, int, int]] = []
        self._origin: Any = None
        self._host_origin = 0
        self.call = 0

    def new_call(self) -> int:
        """Start a new call group; returns its index (the first call is 0 whether or not this is used)."""
        if self._raw and self._raw[-1][0] == self.call:
            self.call += 1
        return self.call

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the body as stage `name` of the current call."""
        if self._origin is None:
            self._origin, self._host_origin = self._clock.mark(), time.perf_counter_ns()
        with nvtx_range(name) if self.nvtx else _nothing():
            host_start, start = time.perf_counter_ns(), self._clock.mark()
            try:
                yield
            finally:
                end, host_end = self._clock.mark(), time.perf_counter_ns()
                self._raw.append((self.call, name, start, end, host_start, host_end))

    def __len__(self) -> int:
        """Number of stage records so far (cheap: resolves nothing)."""
        return len(self._raw)

    def records(self, start: int = 0, stop: int | None = None) -> list[StageRecord]:
        """Stage records [start, stop) in order (synchronizes the device on CUDA)."""
        return [self._resolve(raw) for raw in self._raw[start:stop]]

    def _resolve(self, raw: tuple[int, str, Any, Any, int, int]) -> StageRecord:
        call, name, start, end, host_start, host_end = raw
        since = lambda mark: self._clock.elapsed_ms(self._origin, mark)
        host = lambda ns: (ns - self._host_origin) / 1e6
        return StageRecord(call, name, since(start), since(end), host(host_start), host(host_end))

    def chrome_events(self, pid: int = 1, process: str = "flashrt") -> list[dict[str, Any]]:
        """The stages as Chrome / Perfetto trace events (complete events "X", microseconds on the
        host clock, one thread lane per timer, the call index in args) plus the process-name record.
        Open the file written by `write_chrome_trace` in ui.perfetto.dev or chrome://tracing."""
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                         "args": {"name": process}}]
        for r in self.records():
            events.append({"name": r.stage, "cat": "stage", "ph": "X", "pid": pid, "tid": 0,
                           "ts": r.host_start_ms * 1e3, "dur": (r.host_end_ms - r.host_start_ms) * 1e3,
                           "args": {"call": r.call, "device_ms": r.ms}})
        return events

    def samples(self) -> dict[str, list[float]]:
        """stage -> per-occurrence milliseconds, stages in first-seen order."""
        out: dict[str, list[float]] = {}
        for record in self.records():
            out.setdefault(record.stage, []).append(record.ms)
        return out

    def per_call(self) -> list[dict[str, float]]:
        """One {stage: ms} per call (a stage repeated inside a call is summed)."""
        calls: dict[int, dict[str, float]] = {}
        for record in self.records():
            row = calls.setdefault(record.call, {})
            row[record.stage] = row.get(record.stage, 0.0) + record.ms
        return [calls[k] for k in sorted(calls)]

    def stats(self, rate_hz: float | None = None) -> dict[str, LatencyStats]:
        """stage -> LatencyStats of its samples."""
        return {name: LatencyStats.from_samples(ms, rate_hz) for name, ms in self.samples().items()}

    def reset(self) -> None:
        """Forget every record (the origin is kept so timelines stay comparable)."""
        self._raw.clear()
        self.call = 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class Timer:
    """One interval on the device's clock: `with Timer(device) as t: ...; t.ms`."""

    def __init__(self, device: Any = "cpu"):
        self._clock = _CudaClock(device) if _is_cuda(device) else _HostClock()
        self._start: Any = None
        self._end: Any = None

    def __enter__(self) -> Timer:
        self._start, self._end = self._clock.mark(), None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._clock.mark()

    @property
    def ms(self) -> float:
        """Elapsed milliseconds (synchronizes on CUDA); raises if the interval is not closed."""
        if self._start is None or self._end is None:
            raise RuntimeError("Timer.ms read before the `with` block finished")
        return self._clock.elapsed_ms(self._start, self._end)


def write_chrome_trace(path: Any, events: list[dict[str, Any]]) -> Any:
    """Write Chrome trace JSON (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) to `path`."""
    import json
    from pathlib import Path

    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, allow_nan=False))
    return path
