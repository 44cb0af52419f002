"""Runtime profiler: per-stage timers, NVTX ranges, latency statistics, reports and plots.

    from flashrt.profile import StageTimer, LatencyStats, nvtx_range
    timer = StageTimer(device)
    with timer.stage("replay"):
        graph.replay()
    timer.stats(rate_hz=50)["replay"].to_dict()

Plots need matplotlib (imported only by `flashrt.profile.plots`).
"""

from flashrt.profile.nvtx import nvtx_provider, nvtx_range
from flashrt.profile.report import json_line, stats_table, to_jsonable, write_json
from flashrt.profile.stats import LatencyStats, percentile
from flashrt.profile.timers import StageRecord, StageTimer, Timer

__all__ = ["LatencyStats", "StageRecord", "StageTimer", "Timer", "json_line", "nvtx_provider",
           "nvtx_range", "percentile", "stats_table", "to_jsonable", "write_json"]
