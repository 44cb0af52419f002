"""Shape buckets: one captured graph per bucket, pad + mask helpers, and the fallback counter.

A `GraphSet` owns one Graph per bucket size (prompt length, audio chunk, ...). `bucket_for(size)`
picks the smallest bucket that fits; the caller pads its input to that bucket (`pad_to`), masks the
padding (`length_mask`), populates, then calls `replay(bucket)`. The number of graphs is bounded
(`max_graphs`). A request larger than the largest bucket is an InputError, unless the set was built
with `on_miss="capture"` (a new bucket is captured, counted and reported) or `on_miss="eager"` (fn
for that size runs uncaptured, counted on every call). A `FallbackCounter` records every such event
on the hot path; with `strict=True` each one raises instead.

Ownership: the GraphSet belongs to the frontend that built it, like its graphs (see
`flashrt.runtime.graphs` for how long a graph stays valid). Graphs of one set share the backend
instance, hence (on CUDA) one memory pool: replay them one at a time, never concurrently.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from flashrt.errors import ConfigError, FlashRTError, InputError

log = logging.getLogger(__name__)

ON_MISS = ("error", "capture", "eager")
DEFAULT_MAX_GRAPHS = 16


class FallbackCounter:
    """Counts hot-path fallbacks (eager runs, capture on a miss). `strict=True` raises on each instead.

    Owned by one frontend; cheap enough for the hot path (a dict increment and a bounded deque).
    """

    def __init__(self, strict: bool = False, keep_last: int = 16) -> None:
        self.strict = strict
        self._counts: Counter[str] = Counter()
        self._last: deque[str] = deque(maxlen=keep_last)

    def record(self, kind: str, detail: str, error: type[FlashRTError] = InputError) -> None:
        """Count one fallback of `kind`; in strict mode raise `error(detail)` and count nothing."""
        if self.strict:
            raise error(f"{detail} (strict mode forbids {kind.replace('_', ' ')})")
        self._counts[kind] += 1
        self._last.append(f"{kind}: {detail}")

    def count(self, kind: str | None = None) -> int:
        return self._counts[kind] if kind is not None else sum(self._counts.values())

    def as_dict(self) -> dict[str, Any]:
        return {"strict": self.strict, "total": self.count(), "by_kind": dict(self._counts),
                "last": list(self._last)}

    def reset(self) -> None:
        self._counts.clear()
        self._last.clear()


def pad_to(x: torch.Tensor, length: int, dim: int = -1, value: float | int | bool = 0) -> torch.Tensor:
    """`x` padded at the end of `dim` with `value` up to `length` (a new tensor; InputError if longer)."""
    size = x.shape[dim]
    if size > length:
        raise InputError(f"cannot pad length {size} down to {length} along dim {dim}")
    if size == length:
        return x
    shape = list(x.shape)
    shape[dim] = length
    out = x.new_full(shape, value)
    out.narrow(dim, 0, size).copy_(x)
    return out


def length_mask(n: int | torch.Tensor, bucket: int, device: str | torch.device | None = None) -> torch.Tensor:
    """Bool mask of shape (bucket,) (or (B, bucket) for a 1-D tensor of lengths): True where valid.

    A host-side helper (it validates the lengths, which reads them): use it to fill a static mask
    buffer before replay. Inside a captured fn compare `torch.arange(bucket)` with a lengths buffer.
    """
    lengths = torch.as_tensor(n, device=device)
    if bool((lengths < 0).any()) or bool((lengths > bucket).any()):
        raise InputError(f"length(s) {lengths.tolist()} outside 0..{bucket}")
    positions = torch.arange(bucket, device=lengths.device)
    return positions < lengths.unsqueeze(-1) if lengths.dim() else positions < lengths


def _as_buckets(buckets: Iterable[int]) -> list[int]:
    sizes = sorted({int(b) for b in buckets})
    if not sizes or sizes[0] <= 0:
        raise ConfigError(f"buckets must be positive sizes, got {list(buckets)}")
    return sizes


class GraphSet:
    """One Graph per shape bucket, captured from `build(bucket) -> fn` with one backend.

    `build(bucket)` returns the no-argument fn for that bucket (it usually closes over views of
    max-size buffers, or per-bucket buffers). `buffers` (optional) is passed to every capture.
    With `on_miss` "capture" or "eager", `build` is also called for sizes beyond the declared
    buckets (rounded up to a multiple of `align`), so it must be able to provide buffers for them.

    Hot path, in this order: `bucket = gs.bucket_for(n)` (handles a miss, may call `build`) ->
    pad to `bucket` and populate that bucket's inputs -> `gs.replay(bucket)` -> copy out.
    """

    def __init__(
        self,
        backend: Any,
        build: Callable[[int], Callable[[], Any]],
        buckets: Iterable[int],
        *,
        buffers: Any = None,
        on_miss: str = "error",
        align: int = 1,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        strict: bool = False,
        counter: FallbackCounter | None = None,
    ) -> None:
        if on_miss not in ON_MISS:
            raise ConfigError(f"on_miss={on_miss!r}; choose one of {ON_MISS}")
        self.backend, self.build, self.buffers = backend, build, buffers
        self.on_miss, self.align = on_miss, max(int(align), 1)
        self.buckets = _as_buckets(buckets)
        self.max_graphs = int(max_graphs)
        if len(self.buckets) > self.max_graphs:
            raise ConfigError(f"{len(self.buckets)} buckets declared but max_graphs={self.max_graphs}")
        self.counter = counter if counter is not None else FallbackCounter(strict=strict)
        self._graphs: dict[int, Any] = {}
        self._eager: dict[int, Callable[[], Any]] = {}
        self._capture_s: dict[int, float] = {}
        self._missed: list[int] = []
        self.captures = 0  # every capture ever made (a recapture after load shows here)

    def capture_all(self) -> GraphSet:
        """Capture a graph for every declared bucket not captured yet (load time, not the hot path).
        With flashrt's logging at INFO (`flashrt -v`), a progress bar on stderr shows the buckets."""
        todo = [b for b in self.buckets if b not in self._graphs]
        from tqdm import tqdm

        name = getattr(self.backend, "name", type(self.backend).__name__)
        quiet = not log.isEnabledFor(logging.INFO) or len(todo) < 2
        for bucket in tqdm(todo, desc=f"capture ({name})", unit="bucket", disable=quiet, leave=False):
            self._capture(bucket)
        if todo:
            log.info("captured %d bucket(s) on %s in %.2f s", len(todo), name,
                     sum(self._capture_s[b] for b in todo))
        return self

    def _capture(self, bucket: int) -> Any:
        start = time.perf_counter()
        graph = self.backend.capture(self.build(bucket), self.buffers)
        self._capture_s[bucket] = time.perf_counter() - start
        self._graphs[bucket] = graph
        self.captures += 1
        return graph

    def select(self, size: int) -> int | None:
        """The smallest bucket >= size, or None when size exceeds the largest bucket. No side effects."""
        if int(size) <= 0:
            raise InputError(f"size must be positive, got {size}")
        return next((b for b in self.buckets if b >= size), None)

    def bucket_for(self, size: int) -> int:
        """The bucket to pad `size` to, its graph ready (a declared bucket is captured on first use).

        A miss raises InputError, or is handled per `on_miss` and counted.
        """
        bucket = self.select(size)
        if bucket is None:
            return self._miss(int(size))
        self.graph(bucket)
        return bucket

    def _miss(self, size: int) -> int:
        where = f"size {size} exceeds the largest bucket {self.buckets[-1]}"
        if self.on_miss == "error":
            raise InputError(f"{where}; allowed buckets: {self.buckets} (on_miss='capture' grows the set)")
        bucket = -(-size // self.align) * self.align
        if self.on_miss == "eager":
            self.counter.record("eager_fallback", f"{where}: runs eagerly at {bucket}")
            if bucket not in self._eager:
                self._eager[bucket] = self.build(bucket)
            return bucket
        if len(self.buckets) >= self.max_graphs:
            raise InputError(f"{where} and the set is full (max_graphs={self.max_graphs})")
        self.counter.record("capture_on_miss", f"{where}: captured a new bucket {bucket}")
        self.buckets = sorted([*self.buckets, bucket])
        self._missed.append(bucket)
        self._capture(bucket)
        return bucket

    def graph(self, bucket: int) -> Any:
        """The captured graph of `bucket` (captured on first use if it was declared but not yet)."""
        if bucket not in self.buckets:
            raise InputError(f"no bucket {bucket}; buckets are {self.buckets}")
        graph = self._graphs.get(bucket)
        return graph if graph is not None else self._capture(bucket)

    def replay(self, bucket: int) -> None:
        """Replay the graph of a bucket returned by `bucket_for` (or run its eager fallback)."""
        fallback = self._eager.get(bucket)
        if fallback is None:
            self.graph(bucket).replay()
            return
        with torch.no_grad():
            fallback()

    def __len__(self) -> int:
        return len(self._graphs)

    def report(self) -> dict[str, Any]:
        """Buckets, which are captured, capture seconds per bucket, buckets added on a miss, counters."""
        return {
            "backend": getattr(self.backend, "name", type(self.backend).__name__),
            "buckets": list(self.buckets),
            "captured": sorted(self._graphs),
            "captures": self.captures,
            "capture_s": dict(self._capture_s),
            "captured_on_miss": list(self._missed),
            "eager_buckets": sorted(self._eager),
            "max_graphs": self.max_graphs,
            "on_miss": self.on_miss,
            "fallbacks": self.counter.as_dict(),
        }
