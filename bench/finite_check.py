"""What the load-time weight check costs: `flashrt.io.checks.first_nonfinite` throughput vs a copy.

Regime: CPU, one thread by default, weights already in memory (as `WeightMap.apply` holds each tensor
after reading and casting it). Metric: GB/s of tensor bytes scanned, best of `--repeats`, the check
and a plain `clone()` (what a load already pays per tensor, at least) interleaved on the same tensors.
The estimate at full Pi0 size is `--params` parameters in bf16 divided by the measured rate.

    OMP_NUM_THREADS=1 .venv/bin/python bench/finite_check.py [--gb 1.0] [--repeats 5] [--params 3.5e9]

Prints a table on stderr, then one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flashrt.io.checks import first_nonfinite

LAYER_SHAPES = ((16_384, 2048), (2048, 2048), (256, 2048), (4096, 1024))  # Gemma 2B / 300M matrices


def _tensors(gb: float, dtype: torch.dtype) -> list[torch.Tensor]:
    out, total, g = [], 0, torch.Generator().manual_seed(0)
    while total < gb * 1e9:
        for shape in LAYER_SHAPES:
            out.append(torch.randn(shape, generator=g).to(dtype))
            total += out[-1].numel() * out[-1].element_size()
    return out


def _rate(fn, tensors: list[torch.Tensor]) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    start = time.perf_counter()
    for t in tensors:
        fn(t)
    return nbytes / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="bytes of weights per dtype (GB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--params", type=float, default=3.5e9, help="parameters of the full model")
    args = p.parse_args(argv)
    result = {"bench": "finite_check", "threads": torch.get_num_threads(), "gb": args.gb}
    for dtype in (torch.bfloat16, torch.float32):
        tensors = _tensors(args.gb, dtype)
        check, copy = [], []
        for _ in range(args.repeats):  # interleaved
            check.append(_rate(first_nonfinite, tensors))
            copy.append(_rate(torch.clone, tensors))
        name = str(dtype).removeprefix("torch.")
        result[name] = {"check_gbps": max(check), "clone_gbps": max(copy)}
        del tensors
    full_gb = args.params * 2 / 1e9
    result["full_model"] = {"params": args.params, "bf16_gb": full_gb,
                            "check_s": full_gb / result["bfloat16"]["check_gbps"],
                            "clone_s": full_gb / result["bfloat16"]["clone_gbps"]}
    say = lambda text: print(text, file=sys.stderr)
    say(f"{'dtype':10} {'check GB/s':>11} {'clone GB/s':>11}")
    for name in ("bfloat16", "float32"):
        say(f"{name:10} {result[name]['check_gbps']:11.2f} {result[name]['clone_gbps']:11.2f}")
    fm = result["full_model"]
    say(f"full model: {fm['params']:.3g} params = {fm['bf16_gb']:.1f} GB bf16 -> check {fm['check_s']:.2f} s "
        f"(a clone of the same bytes: {fm['clone_s']:.2f} s), {result['threads']} thread(s)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
