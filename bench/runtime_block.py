"""Benchmark: one transformer block (Gemma layer: attention over a static K/V prefix + GeGLU MLP +
RMSNorm + RoPE), captured replay over static buffers against the same layer called eagerly.

Regime: batch 1, latency of one call; metric: per-stage p50/p90/p99/max, jitter, deadline misses, and
the per-pair speedup (eager ms / replay ms, interleaved A/B). On CPU the captured side is the `trace`
backend (profile cpu-tiny); on CUDA the `cuda` backend (CUDA graphs) with the device's own profile
(h200-bf16, rtx4090-bf16, else cuda-bf16). Prints tables on stderr, then ONE JSON line on stdout.

    python bench/runtime_block.py                      # CPU: trace replay vs eager, cpu-tiny
    python bench/runtime_block.py --device cuda        # GPU: CUDA graph replay vs eager
    python bench/runtime_block.py --profile cpu-small --vs compile --out /tmp/rb
"""

from __future__ import annotations

import argparse
import sys

import typer


def _default_profile(device: str) -> str:
    if device == "cpu":
        return "cpu-tiny"
    import torch

    from flashrt.bench.profiles import list_profiles
    from flashrt.bench.roofline import detect_model

    own = f"{detect_model(torch.cuda.get_device_name(0))}-bf16" if torch.cuda.is_available() else ""
    return own if own in list_profiles() else "cuda-bf16"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", default=None, help="profile name or .toml [per device]")
    parser.add_argument("--backend", default=None, help="graph backend [trace on cpu, profile's on cuda]")
    parser.add_argument("--vs", default="eager", help="second implementation (eager, compile, trace ...)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--out", default=None, help="output folder [bench/results/...]")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)

    from pathlib import Path

    from flashrt.bench.cli import bench

    backend = args.backend or ("trace" if args.device == "cpu" else None)
    try:
        bench("runtime-block", profile=args.profile or _default_profile(args.device), vs=args.vs or None,
              iters=args.iters, warmup=args.warmup, backend=backend, out=Path(args.out) if args.out else None,
              plot=not args.no_plot, progress=sys.stderr.isatty())
    except typer.Exit as done:
        return done.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
