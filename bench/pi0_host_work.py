"""Benchmark (host work): what one `Policy.infer()` costs OUTSIDE the captured step, Pi0 / Pi0.5.

Regime (default): batch 1, RANDOM weights (a lerobot 0.6.1 policy dir written by
`flashrt.testing.synthetic.pi0.write_checkpoint`) at the bench presets of `flashrt.bench.adapters.pi0`
(tiny: 48 x 64 frames into 56 px; small: 480 x 640 frames into 224 px), 2 cameras, uint8 frames, the
eager backend on the CPU (`--device cuda`: CUDA graphs on a GPU). Each call gets its flow-matching
noise as an array (`--noise array`, what `flashrt bench` does) or a seed (`--noise seed`).

Metrics, per preset and variant:

    allocs     tensors allocated per infer() outside the replay (`flashrt.profile.alloc`: a
               TorchDispatchMode counter, the frontend's replay verb paused), after 2 warm-up calls;
               the same for every counted call, and meant to be the same for every model size
    host_ms    median over `--calls` calls of infer() wall time minus its replay stage (the runner's
               timing dict with a `StageTimer` on the device's clock: total_ms - replay_ms; on a GPU
               the replay is then the step's device time, so this is everything else a call waits
               for): checks, tokenization, normalization, the frames resized into the static
               buffers (on the CPU that is host work), the copies out, un-normalization
    host_cpu   the same as this thread's CPU time (time.thread_time): the figure a loaded machine
               does not blur (wall time there includes waiting for a core); CPU runs only (a CUDA
               synchronize spins, and that spinning is CPU time)

    python bench/pi0_host_work.py                      # tiny and small, pi0 and pi05, 50 calls
    python bench/pi0_host_work.py --preset tiny --calls 20
    python bench/pi0_host_work.py --device cuda        # on a GPU: host_ms is the figure (<= 0.3 ms)

Prints a table on stderr and ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

OBS_KEYS = ("images", "state", "prompt")


def measure(variant: str, preset: str, calls: int, noise_mode: str, folder: Path,
            device: str = "cpu") -> dict[str, Any]:
    import torch

    from flashrt.bench.adapters.pi0 import CAMERAS, PRESETS, TOKENIZER_MAX, observations
    from flashrt.profile.alloc import count_infer_allocations
    from flashrt.runner.policy import load_policy
    from flashrt.testing.synthetic.pi0 import SyntheticSpec, write_checkpoint

    p = PRESETS[preset]
    sizes = replace(p.sizes, max_tokens=TOKENIZER_MAX[variant])
    write_checkpoint(folder, SyntheticSpec(variant, sizes, CAMERAS[:2], p.vocab, torch.float32, 0))
    policy = load_policy(folder, device=device, backend="eager" if device == "cpu" else None)
    o = observations(policy.frontend, 1, seed=1, frame=p.frame)[0]
    obs = {k: o[k] for k in OBS_KEYS}
    kwargs = {"noise": o["noise"]} if noise_mode == "array" else {"seed": 7}
    allocs = count_infer_allocations(policy, obs, calls=3, **kwargs)
    wall, cpu = host_times(policy, obs, calls, kwargs)
    return {"variant": variant, "preset": preset, "noise": noise_mode, "allocs": allocs.per_call,
            "by_op": dict(allocs.by_op.most_common()), "host_ms_p50": statistics.median(wall),
            "host_cpu_ms_p50": statistics.median(cpu), "calls": calls, "device": device,
            "allocs_by_device": dict(allocs.by_device)}


def host_times(policy: Any, obs: dict[str, Any], calls: int, kwargs: dict[str, Any]) -> tuple[list, list]:
    """Per call: wall ms outside the replay (the runner's timing: total_ms - replay_ms) and this
    thread's CPU ms outside it (time.thread_time around infer() minus around the replay verb; all torch
    work runs on this thread at 1 thread, so it is the host work without the waits of a loaded box)."""
    from flashrt.profile.timers import StageTimer

    frontend, replay_ns = policy.frontend, [0]
    original = frontend.replay

    def replay(bucket: int) -> None:
        start = time.thread_time_ns()
        original(bucket)
        replay_ns[0] += time.thread_time_ns() - start

    frontend.replay = replay
    wall, cpu = [], []
    try:
        for _ in range(calls):
            replay_ns[0], start = 0, time.thread_time_ns()
            t = policy.infer(obs, timer=StageTimer(policy.frontend.device, nvtx=False), **kwargs)["timing"]
            cpu.append((time.thread_time_ns() - start - replay_ns[0]) / 1e6)
            wall.append(t["total_ms"] - t["replay_ms"])
    finally:
        del frontend.replay
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "small", "both"), default="both")
    parser.add_argument("--variant", choices=("pi0", "pi05", "both"), default="both")
    parser.add_argument("--noise", choices=("array", "seed"), default="array")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per model")
    parser.add_argument("--device", default="cpu", help="cpu (eager backend) or cuda (CUDA graphs)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    presets = ("tiny", "small") if args.preset == "both" else (args.preset,)
    variants = ("pi0", "pi05") if args.variant == "both" else (args.variant,)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            for variant in variants:
                row = measure(variant, preset, args.calls, args.noise, Path(tmp) / f"{variant}-{preset}",
                              args.device)
                rows.append(row)
                print(f"{variant:5} {preset:6} allocs/call {row['allocs']}  host p50 "
                      f"{row['host_ms_p50']:.3f} ms wall, {row['host_cpu_ms_p50']:.3f} ms CPU  "
                      f"({row['by_op']})", file=sys.stderr)
    print(json.dumps({"bench": "pi0_host_work", "noise": args.noise, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
