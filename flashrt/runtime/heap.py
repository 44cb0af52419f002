"""The garbage collector in a latency-critical process: settle the heap once everything is loaded.

    settled = settle()      # after the models are loaded and warmed, before the first tick / request

CPython's cyclic collector runs a full (generation 2) collection now and then, at a moment set by
allocation counts, not by the caller, and a full collection walks every tracked object. A process
holding torch, numpy and a loaded model tracks ~300k objects: a full collection took 130-145 ms on the
2-core CPU VM (2026-12-04; the tiny Orpheus voice or the Pi0.5 demo policy loaded alike), a
stop-the-world pause inside a control tick (seven ticks at 50 Hz) or a request's first audio. During
one `flashrt bench serve` run of the tiny Orpheus voice (1-8x load, 48 requests a level) one full
collection ran after the load, twice over: 203 and 213 ms unsettled, 34 and 36 ms settled (it walked
only what the bench's own client and plots had made since).

`settle` runs one full collection, then `gc.freeze()`: every object alive moves to the permanent
generation, which later collections, full ones included, do not walk. What a process loads at start
(modules, weights, captured graphs, buffers) lives as long as it does, so freezing costs nothing but
this: cyclic garbage among the frozen objects is never reclaimed (garbage made later is collected as
usual). `gc.unfreeze()` undoes it.

The long-running entry points settle after loading: `flashrt serve`, `flashrt serve-policy`, the
in-process servers of `flashrt bench serve` / `bench serve-policy`, `flashrt loop` and the demo. A
library user's control loop or server calls `settle()` once its setup is done (docs/robots.md).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Settled", "settle"]


@dataclass(frozen=True)
class Settled:
    """What `settle` did: ``frozen`` objects now out of the collector's reach (all the permanent
    generation holds), ``collect_ms`` the full collection it ran first (about what each full
    collection would have cost from then on)."""

    frozen: int
    collect_ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (f"heap settled: {self.frozen:,d} objects frozen (a full collection walked them in "
                f"{self.collect_ms:.0f} ms)")


def settle() -> Settled:
    """One full collection, then every live object frozen (module docstring). Call it once loading is
    done; calling it again freezes what was allocated since."""
    start = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - start) * 1e3
    gc.freeze()
    return Settled(gc.get_freeze_count(), collect_ms)
