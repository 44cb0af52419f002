"""`flashrt loop --async`: the same policy, rate and trace run synchronously, then through
`flashrt.AsyncPolicy` (worker-thread inference, real-time chunking where the family supports it),
reported side by side. The asynchronous side primes the episode's first chunk before its clock
starts (`AsyncPolicy.prime`, what a robot does before enabling its motors); the synchronous side's
first tick pays that inference.

Per side: missed and dropped ticks, action age p50 / p99 (from the frame the executed action was
computed from), and the discontinuity at chunk boundaries: max and p50 of |a_t - a_{t-1}| (max over
action dims) over ticks where a new chunk took over, against the same over ticks inside a chunk. For
the asynchronous side also: chunks inferred, late and starved takeovers, and the inference delay
(ticks from request to takeover) p50 / max, and the takeover gap: max |a_new - a_old| between the new
chunk's first executed action and the action the old chunk had planned for the same tick (what
real-time chunking keeps small).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashrt.errors import ConfigError

__all__ = ["AsyncLoopPolicy", "discontinuity", "async_summary", "side_by_side_tables"]


class AsyncLoopPolicy:
    """`flashrt loop`'s view of an `AsyncPolicy` over the benchmark's flashrt `Policy`: the trace's
    `noise` goes to inference, every other key is the observation; `replanned` and `source_step` after
    each step (the loop reads them for boundaries and action age)."""

    def __init__(self, loop_policy: Any, rate_hz: float, transition: str = "auto") -> None:
        from flashrt.runner.async_policy import AsyncPolicy

        inner = getattr(loop_policy, "policy", loop_policy)
        if not hasattr(inner, "frontend") or not hasattr(inner, "infer"):
            raise ConfigError("--async needs a benchmark whose policy() is (or wraps, as .policy) a flashrt "
                              "Policy")
        self.keys = getattr(loop_policy, "obs_keys", None)
        self.async_policy = AsyncPolicy(inner, rate_hz=rate_hz, transition=transition)
        self.chunk_size = inner.n_action_steps
        self.replanned, self.source_step = False, 0

    def step(self, obs: dict[str, Any]) -> np.ndarray:
        noise = obs.get("noise") if isinstance(obs, dict) else None
        if isinstance(obs, dict):
            obs = {k: v for k, v in obs.items() if k != "noise" and (self.keys is None or k in self.keys)}
        action = self.async_policy.step(obs, noise=noise)
        self.replanned, self.source_step = self.async_policy.replanned, self.async_policy.source_step
        return action

    def prime(self, obs: dict[str, Any]) -> None:
        """The episode's first chunk before the clock starts (`AsyncPolicy.prime`)."""
        noise = obs.get("noise") if isinstance(obs, dict) else None
        if isinstance(obs, dict):
            obs = {k: v for k, v in obs.items() if k != "noise" and (self.keys is None or k in self.keys)}
        self.async_policy.prime(obs, noise=noise)

    def reset(self) -> None:
        self.async_policy.reset()

    def close(self) -> None:
        self.async_policy.close()


def discontinuity(boundaries: list[bool], actions: list[Any]) -> dict[str, float]:
    """max / p50 of |a_t - a_{t-1}|_inf at boundary ticks and at inner ticks (failed ticks skipped)."""
    jumps: dict[bool, list[float]] = {True: [], False: []}
    for t in range(1, len(actions)):
        a, b = actions[t - 1], actions[t]
        if a is None or b is None:
            continue
        jumps[bool(boundaries[t])].append(float(np.max(np.abs(np.asarray(b) - np.asarray(a)))))
    out = {}
    for name, key in (("boundary", True), ("inner", False)):
        values = jumps[key]
        out[f"{name}_max"] = max(values) if values else float("nan")
        out[f"{name}_p50"] = float(np.median(values)) if values else float("nan")
    return out


def async_summary(policy: AsyncLoopPolicy) -> dict[str, Any]:
    ap = policy.async_policy
    taken = [c for c in ap.chunks if c.takeover_step >= 0 and c.mode != "first"]
    delays = [c.delay_steps for c in taken]
    latency = [c.latency_ms for c in taken]
    gaps = [c.takeover_gap for c in taken if not np.isnan(c.takeover_gap)]
    return {"transition": ap.transition, "chunks": len(ap.chunks), "late": ap.late, "starved": ap.starved,
            "delay_ticks_p50": float(np.median(delays)) if delays else float("nan"),
            "delay_ticks_max": max(delays) if delays else 0,
            "inference_ms_p50": float(np.median(latency)) if latency else float("nan"),
            "assumed_delay_last": ap.chunks[-1].assumed_delay if ap.chunks else 0,
            "takeover_gap_p50": float(np.median(gaps)) if gaps else float("nan"),
            "takeover_gap_max": max(gaps) if gaps else float("nan")}


def side_by_side_tables(record: dict[str, Any], console: Any = None) -> None:
    """One table: the synchronous and the asynchronous run, row by row."""
    from rich.table import Table

    from flashrt.profile.report import print_tables

    sync, asy = record["loop"], record["loop_async"]
    table = Table(title=f"sync vs --async ({asy['async']['transition']}) @ {sync['config'].rate_hz:g} Hz")
    for col in ("", "sync", "async"):
        table.add_column(col, justify="right" if col else "left")
    counters = (("executed", "executed"), ("missed ticks", "missed"), ("dropped ticks", "dropped_ticks"))
    for label, key in counters:
        table.add_row(label, str(sync[key]), str(asy[key]))
    for stat in ("p50", "p99"):
        table.add_row(f"action age {stat} (ms)", f"{getattr(sync['action_age'], stat):.1f}",
                      f"{getattr(asy['action_age'], stat):.1f}")
    for where, name in (("boundary", "at boundaries"), ("inner", "inside chunks")):
        for stat in ("max", "p50"):
            key = f"{where}_{stat}"
            table.add_row(f"|Δa| {name}, {stat}", f"{sync['discontinuity'][key]:.4f}",
                          f"{asy['discontinuity'][key]:.4f}")
    a = asy["async"]
    table.add_row("late / starved takeovers", "-", f"{a['late']} / {a['starved']}")
    table.add_row("takeover gap p50 / max", "-", f"{a['takeover_gap_p50']:.4f} / {a['takeover_gap_max']:.4f}")
    table.add_row("inference delay, ticks p50 / max", "-",
                  f"{a['delay_ticks_p50']:g} / {a['delay_ticks_max']}")
    print_tables(table, console=console)
