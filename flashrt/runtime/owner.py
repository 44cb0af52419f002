"""One owner of the device: several models share it, and the control loop keeps its deadlines.

    rt = flashrt.Runtime()
    arm = rt.lane("policy", "control", rate_hz=20)         # periodic, a deadline per call (the period)
    voice = rt.lane("speech", "stream")                     # must keep ahead of playback
    rt.adopt(policy, arm)                                   # every graph replay of the model goes through
    rt.adopt(tts, voice)                                    # its lane; no runner changes
    for tick in arm.ticks(2000):                            # sleeps to each release
        with arm.call():                                    # holds the device for the whole step
            action = policy.step(robot.observe())
    rt.report()                                             # per lane: misses, slack, waits, replays

Why: two models in one process otherwise simply compete. On a CPU their kernels fight for the same
cores (two OpenMP pools over two cores), on a GPU their kernels interleave on the SMs; either way a
control step that takes 12 ms alone can take 50 ms while speech runs beside it.

What the runtime does, on every device:

* It is the only gate of the device. A model is adopted into a lane (`adopt`: every captured graph
  reachable from the model object, found once, its ``replay`` wrapped), so each replay first takes the
  device (`Lane.turn`). A long job is thereby split at replay boundaries (an LM decode token, a
  vocoder window, a denoise step): between two of its replays anyone else may go first.
* Who goes first: control before stream before background; among control lanes, the earliest
  deadline; otherwise first come, first served.
* Reservations: a control lane with a rate knows when its next call is released. A stream or
  background replay starts only if it is expected to end (its graph's longest recent duration) before
  that release, less ``guard_ms``. So when a control call is released the device is free, and the call
  waits for nobody. A replay that is longer than any gap the control leaves would never start: once it
  has waited a full control period it goes right after the next control call (no starvation; the
  control lane's report shows the wait it caused, naming the lane).
* `Lane.call()` holds the device across a whole control step (its host work included: on a CPU the
  preprocessing competes for the same cores), records release, start, end, slack and misses; the
  model's own replays inside it pass through (the lane holds the device already).

On CUDA each lane may run its replays on its own stream (``cuda_priority``): control on a
high-priority stream, the rest on a low-priority one, ordered against the caller's stream by events;
buffers are never shared across lanes (each model owns its own). The scheduler's host thread never
synchronizes the device for a lane that does not ask for it. (Written to torch's stream API; not yet
run on a GPU in this repository's tests.)

Reports (`Runtime.report()`, per lane): calls, deadline misses, slack (ms left before each deadline)
p50 / p1, waits for the device and which lane caused them, replays and their duration, and, for stream
lanes fed by `Lane.played`, underruns (playback would have run dry). `chrome_events()` gives one
Perfetto track per lane (ui.perfetto.dev).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from flashrt.errors import ConfigError

__all__ = ["Runtime", "Lane", "KINDS"]

KINDS = {"control": 0, "stream": 1, "background": 2}  # rank: lower goes first
KEEP = 4096          # samples kept per lane (rings)
RECENT = 16          # replay durations per graph the estimate looks at
EVENTS = 20000       # trace events kept per runtime


@dataclass
class _LaneStats:
    calls: int = 0
    misses: int = 0
    slack_ms: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    call_ms: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    wait_ms: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    waited_for: Counter = field(default_factory=Counter)   # lane name -> ms this lane waited on it
    replays: int = 0
    replay_ms: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    deferred: int = 0                                       # replays held back by a reservation
    underruns: int = 0
    underrun_ms: float = 0.0


class Lane:
    """A model's place in a `Runtime` (module docstring). Made by `Runtime.lane`."""

    def __init__(self, runtime: Runtime, name: str, kind: str, rate_hz: float | None,
                 deadline_ms: float | None, cuda_priority: int | None) -> None:
        self.runtime, self.name, self.kind = runtime, name, kind
        self.rank = KINDS[kind]
        self.period_s = 1.0 / rate_hz if rate_hz else None
        self.deadline_s = (deadline_ms / 1e3) if deadline_ms is not None else self.period_s
        self.stats = _LaneStats()
        self.next_release: float | None = None   # control with a rate: when the next call is due
        self.deadline_at: float = float("inf")   # the current call's absolute deadline (EDF)
        self._cuda_priority = cuda_priority
        self._stream: Any = None
        self._events: Any = None
        self._playback: float | None = None       # stream lanes: when queued audio runs out
        self.yields = False                        # preemption points between module calls (`adopt`)
        self._segments: deque = deque(maxlen=RECENT)   # seconds between two preemption points
        self._mark = 0.0                           # the last preemption point (or turn start)
        self._yielded = 0.0                        # seconds given away inside the current turn

    # ------------------------------------------------------------------------------ control calls
    def ticks(self, n: int) -> Iterator[int]:
        """Periodic releases for a control lane: sleeps to each one, yields its index (``n`` ticks).
        A late tick does not queue up: the next release is one period after the late start."""
        if self.period_s is None:
            raise ConfigError(f"lane {self.name!r} has no rate; ticks() paces a control lane with rate_hz")
        release = time.perf_counter()
        for i in range(n):
            self.next_release = release
            now = time.perf_counter()
            if release > now:
                time.sleep(release - now)
            yield i
            release = max(release + self.period_s, time.perf_counter() - self.period_s / 2)
        self.next_release = None

    @contextmanager
    def call(self, release: float | None = None) -> Iterator[None]:
        """One control step holding the device from start to end; its deadline is ``release`` (the
        current tick's, else now) plus the lane's deadline."""
        release = release if release is not None else (self.next_release or time.perf_counter())
        self.deadline_at = release + (self.deadline_s or float("inf"))
        with self.turn("call"):
            try:
                yield
            finally:
                end = time.perf_counter()
                s = self.stats
                s.calls += 1
                s.call_ms.append((end - release) * 1e3)
                if self.deadline_s is not None:
                    slack = (self.deadline_at - end) * 1e3
                    s.slack_ms.append(slack)
                    s.misses += slack < 0
                if self.next_release is not None and self.period_s is not None:
                    self.next_release = release + self.period_s
                self.deadline_at = float("inf")

    # ------------------------------------------------------------------------------ replays
    @contextmanager
    def turn(self, key: Any = None) -> Iterator[None]:
        """Hold the device for one replay (or a control call): waits for this lane's turn (module
        docstring); re-entrant for the thread that holds it."""
        rt = self.runtime
        if rt._holder_thread == threading.get_ident():
            yield
            return
        rt._acquire(self, key)
        start = self._mark = time.perf_counter()
        self._yielded = 0.0
        try:
            with self._on_stream():
                yield
        finally:
            end = time.perf_counter()
            rt._release(self, key, start, end - self._yielded)

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._cuda_priority is None or not torch.cuda.is_available():
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(priority=self._cuda_priority)
            self._events = (torch.cuda.Event(), torch.cuda.Event())
        ready, done = self._events
        caller = torch.cuda.current_stream()
        ready.record(caller)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            yield
        done.record(self._stream)
        caller.wait_event(done)

    # ------------------------------------------------------------------------------ playback
    def played(self, seconds: float, now: float | None = None) -> None:
        """A stream lane hands ``seconds`` of audio to playback now: an underrun is audio that arrives
        after what was queued before it has finished playing (the listener heard a gap)."""
        now = time.perf_counter() if now is None else now
        if self._playback is not None and now > self._playback:
            self.stats.underruns += 1
            self.stats.underrun_ms += (now - self._playback) * 1e3
        self._playback = max(now, self._playback or now) + seconds

    def end_of_speech(self) -> None:
        """The utterance is over: the next audio starts a new playback (no underrun counted between)."""
        self._playback = None

    def report(self) -> dict[str, Any]:
        from flashrt.profile.stats import LatencyStats

        s = self.stats
        out = {"kind": self.kind, "calls": s.calls, "misses": s.misses, "replays": s.replays,
               "deferred_replays": s.deferred,
               "replay_ms": LatencyStats.from_samples(s.replay_ms).to_dict(),
               "wait_ms": LatencyStats.from_samples(s.wait_ms).to_dict(),
               "waited_for_ms": dict(s.waited_for)}
        if self.kind == "control":
            out["call_ms"] = LatencyStats.from_samples(s.call_ms).to_dict()
            out["slack_ms"] = LatencyStats.from_samples(s.slack_ms).to_dict()
            out["rate_hz"] = 1.0 / self.period_s if self.period_s else None
        if self.kind == "stream":
            out["underruns"], out["underrun_ms"] = s.underruns, s.underrun_ms
        return out


class Runtime:
    """The device's one owner (module docstring): lanes, their turns, reservations, reports."""

    def __init__(self, guard_ms: float = 1.0) -> None:
        self.guard_s = guard_ms / 1e3
        self.lanes: dict[str, Lane] = {}
        self._cond = threading.Condition()
        self._holder: Lane | None = None
        self._holder_thread: int | None = None
        self._waiting: dict[int, tuple[Lane, Any, float]] = {}   # ticket -> (lane, key, since)
        self._tickets = itertools.count()
        self._estimate: dict[tuple[str, Any], deque] = {}
        self._events: deque = deque(maxlen=EVENTS)
        self._hooks: dict[int, Any] = {}   # module id -> its preemption hook's handle
        self._t0 = time.perf_counter()

    def lane(self, name: str, kind: str, rate_hz: float | None = None, deadline_ms: float | None = None,
             cuda_priority: int | None = None) -> Lane:
        """A new lane: ``kind`` control (``rate_hz`` for reservations; deadline = the period unless
        ``deadline_ms``), stream or background. ``cuda_priority``: run its replays on a CUDA stream of
        that priority (lower is more urgent in CUDA's numbering; None: the caller's stream)."""
        if kind not in KINDS:
            raise ConfigError(f"lane kind {kind!r}; choose one of {list(KINDS)}")
        if name in self.lanes:
            raise ConfigError(f"a lane named {name!r} exists already")
        if rate_hz is not None and not rate_hz > 0 or deadline_ms is not None and not deadline_ms > 0:
            raise ConfigError(f"lane {name!r}: rate_hz and deadline_ms must be positive")
        lane = Lane(self, name, kind, rate_hz, deadline_ms, cuda_priority)
        self.lanes[name] = lane
        return lane

    # ------------------------------------------------------------------------------ models
    def adopt(self, model: Any, lane: Lane, preempt: bool | None = None) -> int:
        """Route every replay of ``model`` through ``lane`` (the replay points reachable from the model
        object: `find_graphs`; each wrapped once, adopting again moves them). Returns how many.

        ``preempt`` (default: on for stream and background lanes): a replay that runs the model's
        modules in Python (the eager backend) gives the device away between two module calls when a
        control call waits or is about to be released, and takes it back after: a long window (a
        vocoder's 150 ms on a small CPU) then delays control by one module call, not one window.
        Captured graphs (trace, CUDA) run no Python inside a replay: there the replay is the unit (on
        CUDA, stream priorities interleave the kernels instead)."""
        if lane.runtime is not self:
            raise ConfigError(f"lane {lane.name!r} belongs to another Runtime")
        points, modules = find_graphs(model, with_modules=True)
        for point in points:
            _gate(point, lane)
        preempt = lane.kind != "control" if preempt is None else bool(preempt)
        if preempt and modules:
            lane.yields = True
            for module in modules:
                for sub in module.modules():
                    if id(sub) not in self._hooks:
                        self._hooks[id(sub)] = sub.register_forward_pre_hook(partial(_preemption_point, self))
        return len(points)

    def disown(self, model: Any) -> int:
        """Undo `adopt` for ``model``: its replays run ungated again, its preemption points are removed."""
        points, modules = find_graphs(model, with_modules=True)
        for point in points:
            _ungate(point)
        for module in modules:
            for sub in module.modules():
                handle = self._hooks.pop(id(sub), None)
                if handle is not None:
                    handle.remove()
        return len(points)

    def _preempt(self) -> None:
        """A preemption point, on the thread running a module: give the device to a control call that
        waits (or is about to be released), then take it back (`adopt`)."""
        if self._holder_thread != threading.get_ident() or self._holder is None:
            return
        lane = self._holder
        now = time.perf_counter()
        lane._segments.append(now - lane._mark)
        lane._mark = now
        if lane.kind == "control" or not lane.yields or not self._control_due(lane, now):
            return
        with self._cond:
            self._holder, self._holder_thread, self._last_holder = None, None, lane
            self._cond.notify_all()
        self._acquire(lane, "resume")
        back = time.perf_counter()
        lane._yielded += back - now
        lane._mark = back

    def _control_due(self, lane: Lane, now: float) -> bool:
        if any(waiter.rank < lane.rank for waiter, _, _ in list(self._waiting.values())):
            return True
        step = max(lane._segments, default=0.0)
        return any(c.kind == "control" and c.next_release is not None and c.period_s is not None
                   and now + step + self.guard_s > c.next_release and now < c.next_release + c.period_s / 2
                   for c in self.lanes.values())

    # ------------------------------------------------------------------------------ turns
    def _acquire(self, lane: Lane, key: Any) -> None:
        ticket = next(self._tickets)
        asked = time.perf_counter()
        with self._cond:
            self._waiting[ticket] = (lane, key, asked)
            try:
                while True:
                    wait = self._may_start(ticket, lane, key)
                    if wait == 0.0:
                        break
                    if wait < 0:
                        self._cond.wait()
                    else:
                        lane.stats.deferred += 1
                        self._cond.wait(wait)
            finally:
                del self._waiting[ticket]
            holder_before = self._last_holder
            self._holder, self._holder_thread = lane, threading.get_ident()
        waited = (time.perf_counter() - asked) * 1e3
        lane.stats.wait_ms.append(waited)
        if waited > 0.05 and holder_before is not None and holder_before is not lane:
            lane.stats.waited_for[holder_before.name] += waited

    _last_holder: Lane | None = None

    def _release(self, lane: Lane, key: Any, start: float, end: float) -> None:
        if key != "call":
            lane.stats.replays += 1
            lane.stats.replay_ms.append((end - start) * 1e3)
            recent = self._estimate.setdefault((lane.name, key), deque(maxlen=RECENT))
            recent.append(end - start)
        self._events.append((lane.name, "call" if key == "call" else "replay", start, end))
        with self._cond:
            self._holder, self._holder_thread, self._last_holder = None, None, lane
            self._cond.notify_all()

    def _may_start(self, ticket: int, lane: Lane, key: Any) -> float:
        """0: go now; -1: wait for a release of the device; > 0: re-check after that many seconds."""
        if self._holder is not None:
            return -1.0
        first = min(self._waiting, key=lambda t: self._order(t))
        if first != ticket:
            return -1.0
        if lane.kind == "control":
            return 0.0
        return self._reservation_wait(lane, key)

    def _order(self, ticket: int) -> tuple:
        lane, _, since = self._waiting[ticket]
        return (lane.rank, lane.deadline_at if lane.kind == "control" else 0.0, ticket)

    def _reservation_wait(self, lane: Lane, key: Any) -> float:
        """Seconds until this non-control replay may start without running into a control release."""
        now = time.perf_counter()
        recent = lane._segments if lane.yields else self._estimate.get((lane.name, key))
        expected = max(recent) if recent else 0.0
        holds = []
        for control in self.lanes.values():
            release = control.next_release
            if control.kind != "control" or release is None or control.period_s is None:
                continue
            if now + expected + self.guard_s <= release:
                continue  # ends before the release
            if self._starved(lane, control):
                continue
            if now < release:  # wait for the release; after it, for the call (woken when it ends)
                holds.append(release - now + 1e-4)
            elif now < release + control.period_s / 2:
                holds.append(release + control.period_s / 2 - now)
        return min(holds) if holds else 0.0

    def _starved(self, lane: Lane, control: Lane) -> bool:
        """A replay longer than any gap control leaves: it has waited a full period already."""
        oldest = min((since for t, (ln, _, since) in self._waiting.items() if ln is lane), default=None)
        return oldest is not None and time.perf_counter() - oldest > control.period_s

    # ------------------------------------------------------------------------------ reports
    def report(self) -> dict[str, Any]:
        """Per lane (see `Lane.report`)."""
        return {name: lane.report() for name, lane in self.lanes.items()}

    def chrome_events(self, pid: int = 2) -> list[dict[str, Any]]:
        """Chrome trace events, one track (thread) per lane: its calls and replays (ui.perfetto.dev)."""
        tids = {name: i + 1 for i, name in enumerate(self.lanes)}
        events = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
                  for name, tid in tids.items()]
        for name, what, start, end in list(self._events):
            events.append({"ph": "X", "name": what, "pid": pid, "tid": tids.get(name, 0),
                           "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})
        return events


# ------------------------------------------------------------------------------------------ graphs
def _preemption_point(runtime: Runtime, module: Any, args: Any) -> None:
    runtime._preempt()


def find_graphs(root: Any, limit: int = 100_000, with_modules: bool = False) -> Any:
    """Every replay point reachable from ``root``: captured graphs (``replay()``), graph sets and
    frontends (``replay(bucket)``, which may run a window without any graph, e.g. a vocoder at its exact
    length), through flashrt objects' attributes, dicts, lists and tuples (torch modules and tensors are
    not entered). Nested points are all found; a turn is re-entrant, so an inner one passes through."""
    seen, found, modules, todo = set(), [], [], [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, Runtime, Lane)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.jit.ScriptModule):
            continue  # a compiled graph (the jit backend's loop): no Python module call to preempt
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("flashrt.") and hasattr(obj, "__dict__"):
            if callable(getattr(type(obj), "replay", None)) or "_flashrt_ungated" in vars(obj):
                found.append(obj)
            todo.extend(v for k, v in vars(obj).items() if k != "_flashrt_ungated")
    return (found, modules) if with_modules else found


def _gate(point: Any, lane: Lane) -> None:
    original: Callable[..., None] = getattr(point, "_flashrt_ungated", None) or point.replay
    ident = id(point)

    def replay(*args: Any) -> None:
        with lane.turn((ident, args)):
            original(*args)

    point._flashrt_ungated = original
    point._flashrt_lane = lane.name
    point.replay = replay


def _ungate(point: Any) -> None:
    original = vars(point).pop("_flashrt_ungated", None)
    if original is not None:
        vars(point).pop("replay", None)
        vars(point).pop("_flashrt_lane", None)
        if getattr(point, "replay", None) is not original and "replay" not in vars(type(point)):
            point.replay = original
