"""Benchmark: chunk transitions of `flashrt.AsyncPolicy` side by side — real-time chunking ("rtc"),
the linear blend ("blend") and plain replacement ("none") — on one policy, rate and frozen trace.

Regime: the `flashrt loop` control loop (simulated sensor clock) at --rate Hz on a benchmark's policy
(default: tiny random-weight Pi0.5, profile cpu-tiny), --steps ticks per run, the transitions
interleaved over --rounds rounds (order rotating) so machine load hits each alike.

Metric per transition: missed / dropped ticks, starved takeovers, and the takeover gap: max over action
dims of |new chunk's first executed action - the action the old chunk had planned for that tick|,
p50 and max over takeovers (what RTC keeps small; on random weights a chunk is not smooth, so the
tick-to-tick |Δa| cannot show it). Tables on stderr, ONE JSON line on stdout.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async_transitions.py [--rate 50] [--steps 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from flashrt.bench.harness import BenchOptions, build_adapter, freeze_trace, torch_threads
from flashrt.bench.loop import LoopConfig, _timed_loop, warm_up
from flashrt.bench.loop_async import AsyncLoopPolicy, async_summary
from flashrt.bench.profiles import check_device, load_profile

TRANSITIONS = ("rtc", "blend", "none")


def run_one(policy, trace, config: LoopConfig, transition: str) -> dict:
    view = AsyncLoopPolicy(policy, config.rate_hz, transition=transition)
    try:
        warm_up(view, trace[0], config.warmup)
        view.prime(trace[0])
        _, summary = _timed_loop(view, trace, config)
        gaps = [c.takeover_gap for c in view.async_policy.chunks if not np.isnan(c.takeover_gap)]
        return {"missed": summary["missed"], "dropped": summary["dropped_ticks"],
                "starved": view.async_policy.starved, "gaps": gaps, "summary": async_summary(view)}
    finally:
        view.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmark", default="pi05")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    profile = load_profile(args.profile)
    device, cold = check_device(profile), {}
    config = LoopConfig(args.rate, args.steps)
    results = {t: {"missed": 0, "dropped": 0, "starved": 0, "gaps": []} for t in TRANSITIONS}
    with torch_threads(profile.device.threads):
        adapter = build_adapter(args.benchmark, profile, BenchOptions(), device, cold)
        policy, trace = adapter.policy(), freeze_trace(adapter, profile, None)
        for r in range(args.rounds):
            for t in TRANSITIONS[r % 3:] + TRANSITIONS[: r % 3]:
                out = run_one(policy, trace, config, t)
                for key in ("missed", "dropped", "starved"):
                    results[t][key] += out[key]
                results[t]["gaps"] += out["gaps"]
    line = {"benchmark": args.benchmark, "rate_hz": args.rate, "steps": args.steps, "rounds": args.rounds}
    print(f"{'transition':10} {'missed':>7} {'dropped':>8} {'starved':>8} {'takeovers':>10} "
          f"{'gap p50':>8} {'gap max':>8}", file=sys.stderr)
    for t, r in results.items():
        g = r.pop("gaps")
        r.update(takeovers=len(g), gap_p50=float(np.median(g)) if g else None, gap_max=max(g) if g else None)
        print(f"{t:10} {r['missed']:7d} {r['dropped']:8d} {r['starved']:8d} {r['takeovers']:10d} "
              f"{r['gap_p50'] or float('nan'):8.4f} {r['gap_max'] or float('nan'):8.4f}", file=sys.stderr)
        line[t] = r
    print(json.dumps(line))


if __name__ == "__main__":
    main()
