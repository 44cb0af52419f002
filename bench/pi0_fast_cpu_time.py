"""Benchmark: Pi0-FAST process CPU time per call, flashrt `Policy.infer` vs lerobot 0.6.1, same dir.

Regime: batch 1, the parity fixture `tests/fixtures/pi0_fast/cam2` (its six observations: decodes of 1,
11 and 24 tokens), float32, eager backend. Both sides start from the raw observation; lerobot runs its
preprocessor, `predict_action_chunk` and postprocessor (`flashrt.bench.adapters.pi0_fast`). Metric:
`time.process_time()` and wall time per call, A/B interleaved (the order flips every repetition), medians
and their ratio (lerobot / flashrt; > 1: flashrt faster). CPU time is less sensitive than wall time to
other jobs on a shared machine; with OMP_NUM_THREADS=1 it is the work each side does.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:/tmp/sp /work/ref/venv/bin/python bench/pi0_fast_cpu_time.py [--reps 4]

(reference venv; /tmp/sp holds sentencepiece, as for the `lerobot` rows of bench/README.md). Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import flashrt
from flashrt.bench.adapters.pi0_fast import LerobotFastRunner, fixture_observations
from flashrt.profile.timers import StageTimer

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "pi0_fast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    folder, tokenizer = ROOT / "cam2" / "policy", ROOT / "tokenizer.model"
    policy = flashrt.load_policy(folder, tokenizer=tokenizer)
    lerobot = LerobotFastRunner(folder, policy, tokenizer)
    sides = {"flashrt": lambda o: policy.infer(o)["actions"],
             "lerobot": lambda o: lerobot.run(o, StageTimer("cpu"))["actions"]}
    cpu, wall = {k: [] for k in sides}, {k: [] for k in sides}
    for rep in range(args.reps):
        for obs in fixture_observations(ROOT / "cam2", 6):
            outs = {}
            for name in (sorted(sides) if rep % 2 else sorted(sides, reverse=True)):
                c, t = time.process_time(), time.perf_counter()
                outs[name] = sides[name](obs)
                cpu[name].append(time.process_time() - c)
                wall[name].append(time.perf_counter() - t)
            assert np.abs(outs["flashrt"] - outs["lerobot"]).max() <= 1e-4  # quality gate on every call
    med = {f"{kind}_ms_{k}": 1e3 * statistics.median(v[k]) for kind, v in (("cpu", cpu), ("wall", wall))
           for k in sides}
    med["cpu_ratio"] = med["cpu_ms_lerobot"] / med["cpu_ms_flashrt"]
    med["wall_ratio"] = med["wall_ms_lerobot"] / med["wall_ms_flashrt"]
    print(json.dumps({"bench": "pi0_fast_cpu_time", "calls": len(cpu["flashrt"]), **med}))


if __name__ == "__main__":
    main()
