"""CPU threads per op, chosen from the cores actually free.

torch's intra-op pool (OpenMP) splits each op statically across its threads and waits at a barrier for
all of them: when a peer thread is descheduled (another process holds its core), every op waits a
scheduler time slice for it. A VITS voice runs hundreds of small ops per sentence, so two threads on a
2-core CPU with one core busy ran 5-30x slower than one thread (measured: 0.25-0.5 s against 0.02-0.05 s
per stage of a short sentence). onnxruntime's pool lets the calling thread take the late peer's work,
which torch's cannot. So a voice picks its thread count from the cores that are free when it loads:

    load = CpuLoad.probe()                         # usable cores, runnable tasks of other processes
    n = choose_threads("auto", load, ceiling=torch.get_num_threads())
    with torch_threads(n):                         # this thread's ops run on n threads, then restored
        ...

``threads`` (an option of `load_voice`): ``"auto"`` (the default) = the free cores, at most torch's
current setting; an int = exactly that many (the caller's choice, not capped); ``None`` = torch's setting
as it is at each call (the old behaviour). Chosen once at load, so a voice's audio does not change
with the machine's load from call to call (1 and 2 threads differ by float rounding, ~1e-5).

A model whose stages compute at once on their own threads (Orpheus: the LM stage and the SNAC stage
of its chain) shares the free cores between them (``choose_threads(..., stages=2)``): two pools of
torch's default size on two cores oversubscribe them (each op's barrier waits for a descheduled
peer). The count is per thread (torch's intra-op pool is per calling thread once it has started),
so each stage sets it around its own calls (`torch_threads`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from flashrt.errors import ConfigError

__all__ = ["CpuLoad", "choose_threads", "free_cores", "torch_threads", "check_threads"]

AUTO = "auto"


@dataclass(frozen=True)
class CpuLoad:
    """The cores this process may run on and how many of them other processes keep busy."""

    cores: int  # usable cores (the affinity mask)
    busy: float  # runnable tasks of other processes (median of a few samples)

    @classmethod
    def probe(cls, samples: int = 5, gap_s: float = 0.004) -> CpuLoad:
        """Sample /proc/loadavg's running-task count minus this process's own running threads (the
        kernel's instant count, not the 1-minute average, which holds this process's own past work).
        Where /proc is absent: no busy cores known (0)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        counts = []
        for i in range(samples):
            if i:
                time.sleep(gap_s)
            others = _others_running()
            if others is None:
                return cls(cores, 0.0)
            counts.append(others)
        return cls(cores, float(statistics.median(counts)))


def _others_running() -> int | None:
    """Running tasks of other processes now, or None without /proc."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    own = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            own += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(0, running - own)


def free_cores(load: CpuLoad) -> int:
    """Cores not held by other processes' running tasks, at least 1."""
    return max(1, min(load.cores, int(load.cores - load.busy + 0.5)))


def check_threads(threads: int | str | None) -> int | str | None:
    """``"auto"``, None or an int >= 1 (ConfigError otherwise)."""
    if threads is None or threads == AUTO:
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads: expected 'auto', None or an int >= 1, got {threads!r}")
    return threads


def choose_threads(threads: int | str | None, load: CpuLoad | None, ceiling: int,
                   stages: int = 1) -> int | None:
    """The threads a model runs its ops on: an int as given; ``"auto"``: the free cores of `load`
    shared by the model's ``stages`` that compute at once (each on its own thread, e.g. an LM and a
    codec: each gets ``free // stages``, at least 1), at most `ceiling` (torch's setting); None: None
    (torch's setting at each call)."""
    threads = check_threads(threads)
    if threads != AUTO:
        return threads
    if load is None:
        raise ConfigError("threads='auto' needs a CpuLoad")
    if int(stages) < 1:
        raise ConfigError(f"stages must be at least 1, got {stages}")
    return max(1, min(int(ceiling), free_cores(load) // int(stages)))


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block's torch ops (on this thread) on `n` intra-op threads, then restore; None: as is."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)
