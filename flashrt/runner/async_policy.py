"""Asynchronous inference with real-time chunking: `AsyncPolicy(policy)`.

    apolicy = flashrt.AsyncPolicy(policy, rate_hz=50)    # policy from load_policy
    action = apolicy.step(obs)      # every control tick: never waits for a replan (after the first)
    apolicy.reset(); apolicy.close()

A worker thread runs `policy.infer` while the control thread keeps popping actions from the current
chunk. Ticks are `step` calls. Chunk position j of a chunk requested at tick T is meant for tick T + j.

* **When to request.** At the tick where the actions left in the queue (this tick's included) reach
  d + margin, or the current chunk has been executed for n_action_steps - d ticks, whichever comes first;
  d = ceil(latency / period) is the inference delay in ticks, from the largest of the last few measured
  latencies (period = 1 / rate_hz, or the measured interval between `step` calls when no rate is given).
* **When it takes over.** The new chunk replaces the queue at tick T + d: its first d positions are
  dropped (those ticks ran the old chunk's actions). A chunk that is not back by then is late: the old
  chunk keeps running (`on_late="continue"`, counted in `late`) and the new one takes over on the first
  tick it is back, dropping as many positions as ticks passed; if the queue runs dry first, `step`
  waits for it (counted in `starved`). `on_late="wait"` waits at T + d instead (deterministic).
* **Errors.** The observation is checked by `infer` on the worker; an `InputError` (or any error) is
  raised by the `step` that would have taken that chunk over; the old chunk stays queued.
* **Inputs are copied on entry.** `step` / `prime` copy the observation (and noise) into request
  buffers held by the AsyncPolicy, reused while shapes and dtypes stay, before they return: a robot
  loop that reuses its arrays may write the next observation at once, and the worker still infers
  from the one it was given (as the synchronous `Policy` copies into its staging buffers).
* **Lifecycle.** `close()` (or leaving the ``with`` block) stops the worker; `step` after it raises
  `ConfigError` at once. An AsyncPolicy that is dropped without `close()` stops its worker when it is
  garbage-collected (the worker holds no reference to it). The per-tick and per-chunk histories
  (`ages`, `chunks`) keep the last `HISTORY` entries, so memory stays bounded over any episode.
* **Transitions.** "rtc" (where the family supports guidance, `flashrt.runtime.rtc`): the actions
  left in the queue at T are the frozen prefix, weighted 1 for the d that will execute while inferring
  and decaying to 0 at the end of the overlap; the guidance runs inside the captured step. "blend"
  (any family): over the overlap after T + d, the executed action is (1 - a) old + a new with a rising
  linearly from 1/(m+1) to m/(m+1). "none": the new chunk just replaces the old.

Per chunk (`chunks`): request tick, takeover tick, inference delay in ticks and ms, the delay the
guidance assumed, mode, and the takeover gap (how far the new chunk's first executed action is from
the action the old chunk had planned for that tick). Per executed action: `source_step` (the tick
whose observation produced it) and the action age in ticks (`ages`).
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashrt.errors import ConfigError
from flashrt.runtime.rtc import SCHEDULES, Guidance

__all__ = ["AsyncPolicy", "ChunkRecord", "TRANSITIONS"]

TRANSITIONS = ("auto", "rtc", "blend", "none")
LATENCY_WINDOW = 5
HISTORY = 4096  # entries kept of `ages` and of `chunks` (the most recent)


class _History(list):
    """A list that keeps its last ``limit`` entries (trimmed in blocks: amortized O(1) appends)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = HISTORY if limit is None else limit

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) >= 2 * self.limit:
            del self[: len(self) - self.limit]


class _Snapshot:
    """Copies of a caller's observation in buffers reused from one request to the next: arrays and
    tensors are copied into a buffer of the same shape/dtype (allocated the first time), containers
    rebuilt, strings and numbers kept, anything else deep-copied. One request is in flight at a time,
    so one set of buffers serves every request."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Any] = {}

    def take(self, value: Any, path: tuple = ()) -> Any:
        if isinstance(value, np.ndarray):
            return self._array(value, path)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, Mapping):
            return {k: self.take(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.take(v, (*path, i)) for i, v in enumerate(value))
        if value is None or isinstance(value, str | bytes | int | float | bool | np.generic):
            return value
        return copy.deepcopy(value)

    def _array(self, value: np.ndarray, path: tuple) -> np.ndarray:
        buf = self._buffers.get(path)
        if not (isinstance(buf, np.ndarray) and buf.shape == value.shape and buf.dtype == value.dtype):
            buf = self._buffers[path] = np.empty_like(value, order="C")
        np.copyto(buf, value)
        return buf

    def _tensor(self, value: torch.Tensor, path: tuple) -> torch.Tensor:
        buf = self._buffers.get(path)
        if not (isinstance(buf, torch.Tensor) and buf.shape == value.shape and buf.dtype == value.dtype
                and buf.device == value.device):
            buf = self._buffers[path] = torch.empty_like(value, memory_format=torch.contiguous_format)
        with torch.no_grad():
            buf.copy_(value)
        return buf


@dataclass
class ChunkRecord:
    """One inferred chunk: ticks are `step` call indices."""

    index: int
    request_step: int
    assumed_delay: int
    mode: str
    takeover_step: int = -1
    latency_ms: float = 0.0
    frozen: int = 0
    late: bool = False
    takeover_gap: float = float("nan")   # max |new chunk's first action - the old chunk's, same tick|

    @property
    def delay_steps(self) -> int:
        return self.takeover_step - self.request_step


@dataclass
class _Job:
    obs: Mapping[str, Any]
    noise: Any
    seed: int | None
    guide: Guidance | None
    record: ChunkRecord


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} {value!r} is not one of {choices}")
    return value


class AsyncPolicy:
    """A `Policy` stepped by a control thread while its next chunk is inferred on a worker (module
    docstring). One control thread calls `step` / `reset`; the worker is the only caller of `infer`."""

    def __init__(self, policy: Any, rate_hz: float | None = None, transition: str = "auto",
                 margin: int = 1, max_guidance: float = 10.0, schedule: str = "linear",
                 on_late: str = "continue", delay_steps: int | None = None) -> None:
        self.policy = policy
        self.rate_hz = None if rate_hz is None else float(rate_hz)
        if self.rate_hz is not None and not self.rate_hz > 0:
            raise ConfigError(f"rate_hz must be positive, got {rate_hz}")
        supports = bool(getattr(policy.frontend, "supports_guidance", False))
        transition = _check_choice("transition", transition, TRANSITIONS)
        if transition == "rtc" and not supports:
            raise ConfigError(f"{type(policy.frontend).__name__} cannot do real-time chunking; use 'blend'")
        self.transition = ("rtc" if supports else "blend") if transition == "auto" else transition
        self.schedule = _check_choice("schedule", schedule, SCHEDULES)
        self.on_late = _check_choice("on_late", on_late, ("continue", "wait"))
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ConfigError(f"margin must be a non-negative int, got {margin!r}")
        if delay_steps is not None and not 0 < delay_steps < policy.chunk_size:
            raise ConfigError(f"delay_steps must lie in 1..{policy.chunk_size - 1}, got {delay_steps}")
        self.margin, self.max_guidance, self.fixed_delay = margin, float(max_guidance), delay_steps
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.Queue[tuple[ChunkRecord, Any]] = queue.Queue()
        self._snapshot = _Snapshot()
        self._closed = False
        self._worker = threading.Thread(target=_serve, args=(policy, self._jobs, self._done),
                                        name="flashrt-async-policy", daemon=True)
        self._worker.start()
        self._stop = weakref.finalize(self, _stop_worker, self._jobs, self._worker)
        self._reset_state()

    # ------------------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self._queue: deque[tuple[np.ndarray, int]] = deque()   # (action, source step)
        self._pending: ChunkRecord | None = None
        self._executed_in_chunk = 0
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._last_call: float | None = None
        self._period_s: float | None = None if self.rate_hz is None else 1.0 / self.rate_hz
        self.steps = 0
        self._requested = 0  # chunks requested this episode (ChunkRecord.index)
        self.chunks: list[ChunkRecord] = _History()
        self.ages: list[int] = _History()
        self.late = self.starved = 0
        self.replanned = False
        self.source_step = 0

    @property
    def chunk_size(self) -> int:
        return self.policy.chunk_size

    @property
    def n_action_steps(self) -> int:
        return self.policy.n_action_steps

    @property
    def delay_estimate(self) -> int:
        """d: the inference delay in ticks the next request assumes."""
        if self.fixed_delay is not None:
            return self.fixed_delay
        if not self._latencies or not self._period_s:
            return 1
        d = math.ceil(max(self._latencies) / self._period_s - 1e-9)
        return int(min(max(d, 1), self.chunk_size - 1))

    # ------------------------------------------------------------------------------ worker
    def close(self) -> None:
        """Stop the worker (after the chunk in flight); later `step` calls raise ConfigError."""
        self._closed = True
        self._stop()

    def __enter__(self) -> AsyncPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ control thread
    def step(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None) -> np.ndarray:
        """The action for this tick (action_dim,). The first call of an episode waits for its chunk;
        later calls return at once unless the queue ran dry (`starved`)."""
        self._check_open()
        self._tick_clock()
        self.replanned = False
        if not self._queue and self._pending is None:
            self._request(obs, noise, seed, guided=False)
            self._take(self._wait())
        else:
            self._poll(wait=False)
            if self._pending is None and self._due():
                self._request(obs, noise, seed, guided=True)
            while not self._queue:  # ran dry: the only wait of the hot path
                self.starved += 1
                self._poll(wait=True)
        action, source = self._queue.popleft()
        self._executed_in_chunk += 1
        self.source_step = source
        self.ages.append(self.steps - source)
        self.steps += 1
        return action

    def prime(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None) -> None:
        """Infer the episode's first chunk now (blocking, e.g. before the robot's clock starts), so the
        first `step` returns at once; its actions count as computed from the first step's tick."""
        self._check_open()
        if not self._queue and self._pending is None:
            self._request(obs, noise, seed, guided=False)
            self._take(self._wait())
            self.replanned = False

    def reset(self) -> None:
        """New episode: forget the queue; a chunk in flight is waited for and discarded."""
        if self._pending is not None:
            self._wait()
        self._reset_state()

    def _check_open(self) -> None:
        if self._closed or not self._worker.is_alive():
            raise ConfigError("this AsyncPolicy is closed (its worker has stopped); make a new one")

    def _tick_clock(self) -> None:
        now = time.perf_counter()
        if self.rate_hz is None and self._last_call is not None:
            dt = now - self._last_call
            self._period_s = dt if self._period_s is None else 0.8 * self._period_s + 0.2 * dt
        self._last_call = now

    def _due(self) -> bool:
        d = self.delay_estimate
        return (len(self._queue) <= d + self.margin
                or self._executed_in_chunk >= max(1, self.n_action_steps - d))

    def _request(self, obs: Mapping[str, Any], noise: Any, seed: int | None, guided: bool) -> None:
        d = self.delay_estimate if guided else 0
        mode = self.transition if guided else "first"
        record = ChunkRecord(self._requested, self.steps, d, mode, frozen=len(self._queue) if guided else 0)
        self._requested += 1
        guide = None
        if mode == "rtc" and self._queue:
            frozen = np.stack([a for a, _ in self._queue][: self.chunk_size])
            guide = Guidance(frozen, min(d, len(frozen)), len(frozen), self.schedule, self.max_guidance)
        self.chunks.append(record)
        self._pending = record
        obs, noise = self._snapshot.take(obs), self._snapshot.take(noise, ("<noise>",))
        self._jobs.put(_Job(obs, noise, None if seed is None else seed + record.index, guide, record))

    def _wait(self) -> tuple[ChunkRecord, Any]:
        while True:  # a worker that died (never: it catches everything) must not hang the control loop
            try:
                result = self._done.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._worker.is_alive():
                    self._pending = None
                    raise ConfigError("the AsyncPolicy's worker has stopped") from None
        self._pending = None
        return result

    def _poll(self, wait: bool) -> None:
        """Take the chunk in flight over when it is back and due (module docstring)."""
        rec = self._pending
        if rec is None:
            return
        due = self.steps >= rec.request_step + rec.assumed_delay
        if not due and not wait:
            return
        if not wait and self._done.empty():
            if not rec.late:
                rec.late = True
                self.late += 1
            if self.on_late == "continue":
                return
        self._take(self._wait())

    def _take(self, result: tuple[ChunkRecord, Any]) -> None:
        rec, out = result
        if isinstance(out, BaseException):
            raise out
        rec.takeover_step = self.steps
        self._latencies.append(rec.latency_ms / 1e3)
        skip = self.steps - rec.request_step
        actions = out["actions"]
        new = [(a, rec.request_step) for a in actions[skip:]]
        if rec.mode == "blend" and self._queue:
            new = self._blend(new)
        if self._queue and new:  # the first action executed from the new chunk vs the old plan
            rec.takeover_gap = float(np.max(np.abs(new[0][0] - self._queue[0][0])))
        self._queue = deque(new)
        self._executed_in_chunk = 0
        self.replanned = True

    def _blend(self, new: list[tuple[np.ndarray, int]]) -> list[tuple[np.ndarray, int]]:
        old = [a for a, _ in self._queue]
        m = min(len(old), len(new))
        out = []
        for j, (a, src) in enumerate(new):
            alpha = (j + 1) / (m + 1)
            out.append(((1 - alpha) * old[j] + alpha * a, src) if j < m else (a, src))
        return out


def _serve(policy: Any, jobs: queue.Queue, done: queue.Queue) -> None:
    """The worker: infers each job's chunk; holds no reference to its AsyncPolicy (so an AsyncPolicy
    that is dropped is collected, and its finalizer stops this loop)."""
    while (job := jobs.get()) is not None:
        start = time.perf_counter()
        try:
            out: Any = policy.infer(job.obs, noise=job.noise, seed=job.seed, guide=job.guide)
        except BaseException as exc:  # noqa: BLE001 - handed to the control thread, raised there
            out = exc
        job.record.latency_ms = (time.perf_counter() - start) * 1e3
        done.put((job.record, out))


def _stop_worker(jobs: queue.Queue, worker: threading.Thread) -> None:
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=60)
