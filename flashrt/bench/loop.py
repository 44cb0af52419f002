"""`flashrt loop`: a control loop driven by a simulated sensor clock, against any `step(obs)` policy.

The sensor produces a frame every period (1 / rate_hz) at t_k = t_0 + k·period. The controller waits
for tick k, takes frame k (timestamp t_k) and calls `policy.step(obs)`; the action is available at
t_done. Per executed tick:

    latency     t_done - t_start (the step call itself)
    action age  t_done - t_j, where frame j is the observation the executed action was COMPUTED from:
                the frame of the last replanning tick for a chunked policy (a queued action is as old as
                the chunk's observation), frame k itself for a policy that computes every tick
    time to pop t_done - t_k (this tick's frame -> action available; includes wake-up lateness)
    missed      t_done > t_k + period (the action was not ready for the next tick)

A step that overruns makes the loop skip the ticks it covered (`dropped_ticks`); the next frame taken
is the first one after t_done, as a real controller would. Chunk boundaries (steps where a chunked
policy replans) come from the policy's `replanned` attribute after each step when it has one, else
from `chunk_size` (config, or the policy's `chunk_size` attribute): every chunk_size-th executed step.
Latency is reported for all steps, boundary steps and inner steps separately.

Background load (`BackgroundLoad`) burns CPU while the loop runs: "process" workers (separate
processes, competing for cores) or "thread" workers (pure-Python threads in this process, competing
for the GIL), to show how latency holds up on a busy robot computer.

The clock and sleep are injectable, so the accounting is testable with a fake clock.
"""

from __future__ import annotations

import inspect
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashrt.profile.stats import LatencyStats
from flashrt.profile.timers import StageTimer

LOAD_KINDS = ("process", "thread")


@dataclass(frozen=True)
class LoopConfig:
    """rate_hz: control rate; steps: ticks to run; chunk_size: 0 = from the policy; load: workers;
    warmup: untimed steps on frame 0 before the loop (then `policy.reset()`), so the first tick does
    not carry one-time costs (lazy allocation, first replay)."""

    rate_hz: float = 50.0
    steps: int = 500
    chunk_size: int = 0
    load_workers: int = 0
    load_kind: str = "process"
    warmup: int = 1
    async_mode: bool = False   # also run the policy through flashrt.AsyncPolicy (flashrt.bench.loop_async)

    def __post_init__(self) -> None:
        for name, value, bad, rule in (
                ("--rate", self.rate_hz, not (self.rate_hz > 0 and math.isfinite(self.rate_hz)),
                 "a positive number of Hz"),
                ("--steps", self.steps, self.steps < 1, "at least 1"),
                ("--chunk", self.chunk_size, self.chunk_size < 0, "0 (from the policy) or more"),
                ("--load", self.load_workers, self.load_workers < 0, "0 or more"),
                ("warmup", self.warmup, self.warmup < 0, "0 or more")):
            if bad:
                raise ValueError(f"loop {name} {value}: must be {rule}")
        if self.load_kind not in LOAD_KINDS:
            raise ValueError(f"load_kind {self.load_kind!r} is not one of {LOAD_KINDS}")

    @property
    def period_ms(self) -> float:
        return 1000.0 / self.rate_hz


@dataclass(frozen=True)
class Tick:
    """One executed tick (times in ms since the loop started)."""

    index: int
    obs_ms: float
    start_ms: float
    done_ms: float
    missed: bool
    boundary: bool
    dropped_before: int
    error: str = ""
    source_obs_ms: float | None = None   # time of the frame the executed action was computed from
    stages: tuple[tuple[str, float, float], ...] = ()   # (stage, start ms, duration ms) inside the step

    @property
    def latency_ms(self) -> float:
        return self.done_ms - self.start_ms

    @property
    def action_age_ms(self) -> float:
        """Observation (the one the action came from) -> action executed."""
        return self.done_ms - (self.obs_ms if self.source_obs_ms is None else self.source_obs_ms)

    @property
    def time_to_pop_ms(self) -> float:
        """This tick's frame -> action available."""
        return self.done_ms - self.obs_ms


def _burn_until(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003


@dataclass
class BackgroundLoad:
    """Context manager running `workers` CPU burners ("process" or "thread") until exit."""

    workers: int = 0
    kind: str = "process"
    _stop: Any = field(default=None, init=False)
    _running: list[Any] = field(default_factory=list, init=False)

    def __enter__(self) -> BackgroundLoad:
        if self.workers:
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
            self._stop = ctx.Event() if self.kind == "process" else threading.Event()
            make = ctx.Process if self.kind == "process" else threading.Thread
            self._running = [make(target=_burn_until, args=(self._stop,), daemon=True)
                             for _ in range(self.workers)]
            for worker in self._running:
                worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop.set()
        for worker in self._running:
            worker.join(timeout=5)
        self._running = []


def _boundary(policy: Any, executed: int, chunk_size: int) -> bool:
    flag = getattr(policy, "replanned", None)
    if isinstance(flag, bool):
        return flag
    return chunk_size > 0 and executed % chunk_size == 0


def run_loop(policy: Any, observe: Callable[[int], Any], config: LoopConfig,
             clock: Callable[[], float] = time.perf_counter,
             sleep: Callable[[float], None] = time.sleep, actions: list | None = None) -> list[Tick]:
    """Run the loop (see module doc); `observe(k)` returns frame k. Returns the executed ticks;
    `actions`, when given, receives each tick's action (None for a failed tick).

    A policy with an int `source_step` attribute (`flashrt.AsyncPolicy`'s loop view) names the executed
    tick whose frame its action came from; the action age counts from that frame. A policy whose
    ``step`` takes ``timer=`` (`flashrt.Policy`) has its stages recorded per tick (`Tick.stages`)."""
    chunk = config.chunk_size or int(getattr(policy, "chunk_size", 0) or 0)
    timer = StageTimer("cpu", nvtx=False) if _takes_timer(policy) else None
    kwargs = {"timer": timer} if timer is not None else {}
    period = config.period_ms
    ticks: list[Tick] = []
    source: float | None = None   # frame time of the chunk being executed
    t0 = clock()
    now_ms = lambda: (clock() - t0) * 1e3
    k = 0
    while k < config.steps:
        wait = k * period - now_ms()
        if wait > 0:
            sleep(wait / 1e3)
        obs, start, error, action = observe(k), now_ms(), "", None
        first = len(timer) if timer is not None else 0
        try:
            action = policy.step(obs, **kwargs)
        except Exception as exc:  # counted as a missed tick, never dropped
            error = f"{type(exc).__name__}: {exc}"
        if actions is not None:
            actions.append(action)
        done = now_ms()
        missed = bool(error) or done > (k + 1) * period
        dropped = k - ticks[-1].index - 1 if ticks else 0
        boundary = _boundary(policy, len(ticks), chunk)
        fresh = boundary or (chunk <= 0 and not isinstance(getattr(policy, "replanned", None), bool))
        source = k * period if fresh or source is None else source   # no chunking known: every tick
        src = getattr(policy, "source_step", None)
        if isinstance(src, int) and not isinstance(src, bool) and 0 <= src < len(ticks):
            source = ticks[src].obs_ms
        stages = _tick_stages(timer, first, start) if timer is not None else ()
        ticks.append(Tick(k, k * period, start, done, missed, boundary, dropped, error, source, stages))
        k = max(k + 1, math.ceil(done / period - 1e-9)) if missed else k + 1
    return ticks


def _takes_timer(policy: Any) -> bool:
    try:
        return "timer" in inspect.signature(policy.step).parameters
    except (TypeError, ValueError):
        return False


def _tick_stages(timer: StageTimer, first: int, start_ms: float) -> tuple[tuple[str, float, float], ...]:
    """This tick's stage records as (stage, start, duration) in ms on the loop's clock: the host clock's
    offsets from the tick's first stage, anchored at the tick's start."""
    records = timer.records(first)
    if not records:
        return ()
    origin = records[0].host_start_ms
    return tuple((r.stage, start_ms + r.host_start_ms - origin, r.host_end_ms - r.host_start_ms)
                 for r in records)


def summarize_loop(ticks: list[Tick], config: LoopConfig) -> dict[str, Any]:
    """Deadline misses, dropped ticks, latency / action age / interval statistics, chunk boundaries."""
    ok = [t for t in ticks if not t.error]
    lat = lambda sel: LatencyStats.from_samples([t.latency_ms for t in sel], config.rate_hz)
    intervals = [b.done_ms - a.done_ms for a, b in zip(ok, ok[1:])]
    dropped = sum(t.dropped_before for t in ticks)   # + the ticks a late last step ran past:
    dropped += config.steps - 1 - ticks[-1].index if ticks else config.steps
    return {"config": config, "executed": len(ticks), "errors": sum(bool(t.error) for t in ticks),
            "missed": sum(t.missed for t in ticks), "dropped_ticks": dropped,
            "miss_rate": sum(t.missed for t in ticks) / max(1, len(ticks)),
            "latency": LatencyStats.from_samples([t.latency_ms for t in ok], config.rate_hz,
                                                 failures=len(ticks) - len(ok)),
            "action_age": LatencyStats.from_samples([t.action_age_ms for t in ok]),
            "time_to_pop": LatencyStats.from_samples([t.time_to_pop_ms for t in ok]),
            "action_interval": LatencyStats.from_samples(intervals),
            "boundaries": sum(t.boundary for t in ok),
            "latency_boundary": lat([t for t in ok if t.boundary]),
            "latency_inner": lat([t for t in ok if not t.boundary])}


def warm_up(policy: Any, obs: Any, steps: int) -> None:
    """`steps` untimed calls of `policy.step(obs)`, then `policy.reset()` when it has one."""
    for _ in range(steps):
        policy.step(obs)
    getattr(policy, "reset", lambda: None)()


def _policy_of(adapter: Any, name: str) -> Any:
    from flashrt.errors import ConfigError

    make = getattr(adapter, "policy", None)
    if not callable(make):
        raise ConfigError(f"benchmark {name!r} offers no policy(); `flashrt loop` needs an adapter whose "
                          "policy() returns an object with step(obs)")
    return make()


def run_loop_benchmark(name: str, profile: Any, config: LoopConfig, checkpoint: str | None = None) -> dict:
    """Build benchmark `name`'s policy under `profile` and run the loop on its frozen trace."""
    from flashrt.bench.env import environment
    from flashrt.bench.harness import BenchOptions, build_adapter, freeze_trace, torch_threads
    from flashrt.bench.profiles import check_device
    from flashrt.runtime.heap import settle

    device, cold = check_device(profile), {}
    with torch_threads(profile.device.threads):
        adapter = build_adapter(name, profile, BenchOptions(checkpoint=checkpoint), device, cold)
        policy = _policy_of(adapter, name)
        trace = freeze_trace(adapter, profile, None)
        warm_up(policy, trace[0], config.warmup)
        heap = settle()  # what a control loop does once set up (flashrt.runtime.heap)
        with BackgroundLoad(config.load_workers, config.load_kind):
            ticks, summary = _timed_loop(policy, trace, config)
            sides = _async_side(policy, trace, config) if config.async_mode else {}
    return {"schema": "flashrt.loop.result/1", "kind": "loop", "benchmark": name, "status": "ok",
            "profile": profile.to_dict(), "trace": trace.record(), "cold_start_ms": cold,
            "loop": summary, "ticks": _columns(ticks), **sides, "heap": heap.to_dict(), "env": environment()}


def _timed_loop(policy: Any, trace: Any, config: LoopConfig) -> tuple[list[Tick], dict[str, Any]]:
    from flashrt.bench.loop_async import discontinuity

    actions: list = []
    ticks = run_loop(policy, lambda k: trace[k], config, actions=actions)
    summary = summarize_loop(ticks, config)
    summary["discontinuity"] = discontinuity([t.boundary for t in ticks], actions)
    return ticks, summary


def _async_side(policy: Any, trace: Any, config: LoopConfig) -> dict[str, Any]:
    """The same policy and trace through flashrt.AsyncPolicy (flashrt.bench.loop_async)."""
    from flashrt.bench.loop_async import AsyncLoopPolicy, async_summary

    async_policy = AsyncLoopPolicy(policy, config.rate_hz)
    try:
        warm_up(async_policy, trace[0], config.warmup)
        async_policy.prime(trace[0])
        ticks, summary = _timed_loop(async_policy, trace, config)
        summary["async"] = async_summary(async_policy)
    finally:
        async_policy.close()
    return {"loop_async": summary, "ticks_async": _columns(ticks)}


def _columns(ticks: list[Tick]) -> dict[str, list]:
    """Per-tick arrays (index, obs/start/done ms, missed, boundary) for plots and later analysis."""
    return {"index": [t.index for t in ticks], "obs_ms": [t.obs_ms for t in ticks],
            "source_obs_ms": [t.done_ms - t.action_age_ms for t in ticks],
            "start_ms": [t.start_ms for t in ticks], "done_ms": [t.done_ms for t in ticks],
            "missed": [t.missed for t in ticks], "boundary": [t.boundary for t in ticks],
            "stages": [[list(st) for st in t.stages] for t in ticks]}


def loop_tables(record: dict[str, Any], console: Any = None) -> None:
    """Tables for people: loop counters and the latency / action-age statistics."""
    from flashrt.profile.report import kv_table, print_tables, stats_table

    s = record["loop"]
    counters = {k: s[k] for k in ("executed", "missed", "miss_rate", "dropped_ticks", "errors", "boundaries")}
    stats = {"step latency": s["latency"], "  at chunk boundary": s["latency_boundary"],
             "  inside a chunk": s["latency_inner"], "action age (obs -> executed)": s["action_age"],
             "time to pop": s["time_to_pop"], "action interval": s["action_interval"]}
    cfg = s["config"]
    title = f"loop {record['benchmark']} @ {cfg.rate_hz:g} Hz, load {cfg.load_workers} {cfg.load_kind}"
    print_tables(kv_table(counters, title), stats_table(stats, "loop (ms)"), console=console)


def loop_figure(record: dict[str, Any], path: Any) -> Any:
    """Per-tick step latency and action age against the period, misses and boundaries marked."""
    from flashrt.profile.plots import plot_panels

    t = record["ticks"]
    lat = [d - s for s, d in zip(t["start_ms"], t["done_ms"])]
    age = [d - o for o, d in zip(t["source_obs_ms"], t["done_ms"])]
    pick = lambda flags, ys, marker: ([i for i, f in zip(t["index"], flags) if f],
                                      [y for y, f in zip(ys, flags) if f], marker)
    period = record["loop"]["config"].period_ms
    panels = [("step latency per tick", "tick", "ms",
               {"latency": (t["index"], lat), "chunk boundary": pick(t["boundary"], lat, "o"),
                "missed": pick(t["missed"], lat, "x")}, {"period": period}),
              ("action age (the observation it came from -> executed)", "tick", "ms",
               {"action age": (t["index"], age), "missed": pick(t["missed"], age, "x")},
               {"period": period})]
    return plot_panels(path, panels, f"flashrt loop · {record['benchmark']}")


def loop_chrome_events(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every executed tick's ``step`` as Chrome / Perfetto complete events (microseconds since the loop
    started; args: tick, boundary, missed, action age), one process per side (sync; async with
    ``--async``), plus instant events at the frames the sensor produced (``frame``), and a flashrt
    Policy's stages nested inside each sync step (``validate`` every tick; ``h2d``, ``replay``,
    ``postprocess`` when the tick replans)."""
    events: list[dict[str, Any]] = []
    sides = (("ticks", "flashrt loop"), ("ticks_async", "flashrt loop --async"))
    for pid, (key, label) in enumerate(sides, 1):
        t = record.get(key)
        if not t:
            continue
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        for i, index in enumerate(t["index"]):
            start, done = t["start_ms"][i], t["done_ms"][i]
            events.append({"name": "step", "cat": "loop", "ph": "X", "pid": pid, "tid": 0,
                           "ts": start * 1e3, "dur": max(0.0, done - start) * 1e3,
                           "args": {"tick": index, "boundary": t["boundary"][i], "missed": t["missed"][i],
                                    "action_age_ms": done - t["source_obs_ms"][i]}})
            events.append({"name": "frame", "cat": "loop", "ph": "i", "s": "t", "pid": pid, "tid": 0,
                           "ts": t["obs_ms"][i] * 1e3, "args": {"tick": index}})
            for stage, at, dur in t.get("stages", [[]] * len(t["index"]))[i]:   # nested inside the step
                events.append({"name": stage, "cat": "stage", "ph": "X", "pid": pid, "tid": 0,
                               "ts": at * 1e3, "dur": dur * 1e3, "args": {"tick": index}})
    return events
