"""The `cuda` graph backend: `torch.cuda.CUDAGraph` with side-stream warm-up and a shared pool.

Capture: fn runs `warmup` times on a side stream (lazy cuBLAS/cuDNN initialisation, autotuning and
allocator growth happen there, not inside the graph), then once under `torch.cuda.graph` on the
same stream, into the memory pool of the backend instance. A failed capture is re-raised as a
CaptureError listing the likely causes with numbered fixes.

Ownership and lifetime:

* `GraphPool` — one per frontend (a backend instance makes its own unless given one). It holds the
  private memory pool every graph of that frontend allocates its intermediates from, and the side
  stream they were captured on. Graphs sharing a pool may reuse each other's intermediate memory,
  so they must be replayed one at a time (never concurrently on two streams). Valid for the
  process lifetime of the frontend; drop the pool together with its graphs.
* `CudaGraph` — owned by the frontend that captured it. Valid while the static buffers and weights
  keep their storage (see `flashrt.runtime.graphs`). Results must be read from the static output
  buffers: tensors that fn returned live in the pool and are overwritten by the next replay of any
  graph of the pool, so they are dropped at capture.
* Streams: after a capture, failed or not, the caller's current stream is the one it had before
  (`restore_stream`; torch.cuda.graph alone leaves its capture stream current when capture fails).

Stream priority: with `priority=None` a graph replays on the caller's current stream. With an
integer priority (lower is more urgent, e.g. -1 for a control loop) it replays on the pool's
priority stream, ordered after the caller's pending work and before the caller's next work.
Constructors have no side effects: the pool and the streams are created on first capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flashrt.errors import CaptureError, DeviceError
from flashrt.runtime.device import resolve_device
from flashrt.runtime.graphs import BufferGuard, named_tensors

LIKELY_CAUSES = (
    "host sync inside fn (.item(), .cpu(), .tolist(), print, bool(tensor) / `if tensor:`, "
    "torch.cuda.synchronize): keep values on the device or move the read outside fn",
    "allocation that is new at capture or sized by tensor values: preallocate in Buffers at static "
    "(bucket) sizes; raise `warmup` if a lazily created workspace is allocated on first use",
    "CPU tensors used inside fn (a buffer, a weight, or a tensor literal made on the CPU): move them to "
    "the device at load time",
    "random ops inside fn: let randomness enter through a static input buffer (noise=, seed=)",
    "data-dependent shapes (nonzero, boolean-mask indexing, masked_select, unique): use masks and "
    "torch.where at static shapes",
    "work on another stream inside fn, or another thread using CUDA during capture: keep capture on one "
    "stream, or pass capture_error_mode='thread_local'",
)

DIAGNOSE = ("Run the same fn with get_backend('trace') on CPU tensors to get the op and the source line "
            "that break the graph.")


@contextlib.contextmanager
def restore_stream(device: torch.device) -> Iterator[None]:
    """The caller's current stream of ``device`` is current again when the block exits, however it exits.

    `torch.cuda.graph` makes its capture stream current on entry and restores the caller's only after a
    successful ``capture_end``: when the capture fails (a host sync inside fn invalidates it and
    ``capture_end`` raises), the capture stream would stay current for everything the caller runs next."""
    caller = torch.cuda.current_stream(device)
    try:
        yield
    finally:
        if torch.cuda.current_stream(device) != caller:
            torch.cuda.set_stream(caller)


def capture_error(exc: BaseException, what: str) -> CaptureError:
    """A CaptureError for a failed capture: the original error, then numbered likely causes."""
    causes = "\n".join(f"  {i}. {c}" for i, c in enumerate(LIKELY_CAUSES, 1))
    return CaptureError(f"{what} failed: {type(exc).__name__}: {exc}\nLikely causes:\n{causes}\n{DIAGNOSE}")


class GraphPool:
    """The memory pool and capture/replay streams shared by one frontend's CUDA graphs."""

    def __init__(self, device: str | torch.device = "cuda", priority: int | None = None) -> None:
        self.device = resolve_device(device)
        if self.device.type != "cuda":
            raise DeviceError(f"a CUDA graph pool needs a CUDA device, got {self.device}")
        self.priority = priority
        self._handle: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    @property
    def stream(self) -> torch.cuda.Stream:
        """Side stream for warm-up and capture; also the replay stream when a priority is set."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device, priority=self.priority or 0)
        return self._stream


class CudaGraph:
    """A captured torch.cuda.CUDAGraph; `replay()` launches it (see module docstring for streams)."""

    backend = "cuda"

    def __init__(self, graph: torch.cuda.CUDAGraph, pool: GraphPool, guard: BufferGuard | None) -> None:
        self._graph = graph
        self.pool = pool
        self._guard = guard
        self._stream = pool.stream if pool.priority is not None else None
        # the two cross-stream orderings of a priority replay, created once: Stream.wait_stream would
        # make a new CUDA event per call (a wait takes the event's last record, so reuse is safe)
        self._events = (torch.cuda.Event(), torch.cuda.Event()) if self._stream is not None else None

    def replay(self, times: int = 1) -> None:
        for _ in range(times):
            self._replay_once()

    def _replay_once(self) -> None:
        if self._guard is not None:
            self._guard.check()
        if self._stream is None:
            self._graph.replay()
            return
        ready, done = self._events
        caller = torch.cuda.current_stream(self.pool.device)
        ready.record(caller)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            self._graph.replay()
        done.record(self._stream)
        caller.wait_event(done)

    def check(self) -> None:
        if self._guard is not None:
            self._guard.check()


def _check_on_device(buffers: Any, device: torch.device) -> None:
    off = [n for n, t in named_tensors(buffers).items() if t.device != device]
    if off:
        raise CaptureError(f"buffer(s) {off} are not on {device}; a CUDA graph can only use device memory. "
                           "Allocate Buffers on the graph's device.")


class CudaBackend:
    """torch.cuda.CUDAGraph capture; one GraphPool per backend instance (i.e. per frontend)."""

    name = "cuda"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        pool: GraphPool | None = None,
        warmup: int = 3,
        priority: int | None = None,
        check_buffers: bool = True,
        capture_error_mode: str = "global",
    ) -> None:
        self.pool = pool if pool is not None else GraphPool(device, priority)
        self.device = self.pool.device
        self.warmup = int(warmup)
        self.check_buffers = check_buffers
        self.capture_error_mode = capture_error_mode

    def _warm_up(self, fn: Callable[[], Any]) -> None:
        stream = self.pool.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _record(self, fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle, stream=self.pool.stream,
                              capture_error_mode=self.capture_error_mode):
            fn()  # return value dropped on purpose: it lives in the pool (see module docstring)
        return graph

    def capture(self, fn: Callable[[], Any], buffers: Any = None) -> CudaGraph:
        if not callable(fn):
            raise CaptureError(f"capture needs a no-argument callable, got {type(fn).__name__}")
        _check_on_device(buffers, self.device)
        with torch.no_grad(), torch.cuda.device(self.device):
            self._warm_up(fn)  # errors here are fn's own (it fails eagerly too): raised unchanged
            try:
                with restore_stream(self.device):
                    graph = self._record(fn)
            except Exception as exc:
                raise capture_error(exc, "CUDA graph capture") from exc
        guard = BufferGuard(buffers) if self.check_buffers and buffers is not None else None
        return CudaGraph(graph, self.pool, guard)
