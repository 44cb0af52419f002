"""Process and device memory readings: current and peak RSS, CUDA allocated/reserved peaks."""

from __future__ import annotations

import os
import resource
import sys
from typing import Any


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started (VmHWM; getrusage elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def cuda_memory(device: str) -> dict[str, int] | None:
    """Peak and current CUDA allocated/reserved bytes on `device` (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return {"peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}


def reset_cuda_peaks(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def snapshot(device: str) -> dict[str, Any]:
    """{'rss', 'peak_rss', 'cuda'} now."""
    return {"rss": rss_bytes(), "peak_rss": peak_rss_bytes(), "cuda": cuda_memory(device)}
