"""int8 GEMM kernels against the float32 GEMM at the Pi0 `small` preset's shapes (CPU, one thread).

Regime: one GEMM y = x @ w.T + nothing, x (M, K) float32 in, y float32 out; the int8 kernels include
quantizing x (static per-tensor scale) and the dequantizing epilogue, as `flashrt.quant.linear` runs
them. Metric: median microseconds over interleaved rounds (every kernel once per round, in turn), and
fp32 / kernel (> 1: the int8 kernel is faster). Kernels: `torch._int_mm`, oneDNN's u8 x s8 GEMM, and
the same integers in a float32 GEMM (`flashrt.quant.linear.INT8_KERNELS`); fp32 is `F.linear`.

    OMP_NUM_THREADS=1 python bench/int8_gemm.py [--rounds 15] [--json]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812

from flashrt.quant import linear as L

# (stage, M, K, N) of the small preset: 2 cameras x 256 tokens, prompt bucket 64, 50 action rows
SHAPES = (("vision qkv", 512, 128, 384), ("vision fc1", 512, 128, 512), ("vision fc2", 512, 512, 128),
          ("vlm qkv", 576, 256, 320), ("vlm gate_up", 576, 256, 2048), ("vlm down", 576, 1024, 256),
          ("expert qkv", 50, 128, 320), ("expert gate_up", 50, 128, 1024), ("expert down", 50, 512, 128))


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(m: int, k: int, n: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
    qw = L.quantize_weight(w, "int8", x.abs().amax())
    runs = {"fp32": lambda: F.linear(x, w)}
    for name, kernel in L.INT8_KERNELS.items():
        if kernel.applies(qw, x):
            runs[name] = (lambda kern: lambda: kern.run(qw, x, None))(kernel)
    slow = {}
    for name, fn in runs.items():
        fn()  # warm-up, prepares the kernel's weight form
        slow[name] = _once(fn)
    fastest = min(slow.values())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            if slow[name] > 20 * fastest:  # torch._int_mm's CPU fallback: one call is enough to say so
                times[name] = [slow[name]]
                continue
            times[name].append(_once(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args()
    rows = []
    for stage, m, k, n in SHAPES:
        us = measure(m, k, n, args.rounds)
        rows.append({"stage": stage, "M": m, "K": k, "N": n, "us": {kk: round(v, 1) for kk, v in us.items()},
                     "fp32_over": {kk: round(us["fp32"] / v, 2) for kk, v in us.items() if kk != "fp32"}})
        if not args.json:
            ratios = "  ".join(f"{kk} {v}x" for kk, v in rows[-1]["fp32_over"].items())
            print(f"{stage:15} {m:4}x{k:5}x{n:5}  fp32 {us['fp32']:9.1f} us  {ratios}", flush=True)
    print(json.dumps({"bench": "int8_gemm", "threads": torch.get_num_threads(),
                      "activation_qmax": L.activation_qmax("cpu"), "rows": rows}))


if __name__ == "__main__":
    main()
