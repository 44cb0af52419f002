"""Roofline: what fraction of the device's peak compute and bandwidth a call reaches.

A frontend reports FLOPs and bytes per call (`flops_bytes()`); with the p50 latency that gives the
achieved TFLOP/s and GB/s, compared with the peak of the device. GPU peaks come from the table below
(vendor datasheets, dense tensor-core math: FP32 accumulate for bf16 and fp8 where the vendor gives
both; Jetson rows derived from the published sparse FP4/INT8 figures, marked "derived"). On the CPU
the peak is measured: a quick fp32 matmul GFLOP/s probe and a memcpy GB/s probe, cached per process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DevicePeak:
    """Peak dense throughput of one device: TFLOP/s per precision and memory bandwidth in GB/s."""

    name: str
    match: tuple[str, ...]
    tflops: dict[str, float]
    bandwidth_gbs: float
    source: str

    def peak_tflops(self, precision: str) -> float | None:
        return self.tflops.get(_COMPUTE_CLASS.get(precision, precision))


_COMPUTE_CLASS = {"fp16": "bf16"}

DEVICE_PEAKS: dict[str, DevicePeak] = {p.name: p for p in (
    DevicePeak("h100", ("H100",), {"fp32": 67.0, "bf16": 989.4, "fp8": 1978.9, "int8": 1978.9},
               3350.0, "H100 SXM5 datasheet, dense"),
    DevicePeak("h200", ("H200",), {"fp32": 67.0, "bf16": 989.4, "fp8": 1978.9, "int8": 1978.9},
               4800.0, "H200 SXM datasheet, dense"),
    DevicePeak("rtx4090", ("RTX 4090",), {"fp32": 82.6, "bf16": 165.2, "fp8": 330.3, "int8": 660.6},
               1008.0, "Ada whitepaper, dense, FP32 accumulate"),
    DevicePeak("rtx5090", ("RTX 5090",), {"fp32": 104.8, "bf16": 209.5, "fp8": 419.0, "int8": 838.0},
               1792.0, "RTX Blackwell whitepaper, dense, FP32 accumulate"),
    DevicePeak("orin", ("Orin",), {"fp32": 5.3, "bf16": 42.5, "int8": 85.0},
               204.8, "Jetson AGX Orin 64GB GPU: derived from 170 sparse INT8 TOPS"),
    DevicePeak("thor", ("Thor",), {"bf16": 258.8, "fp8": 517.5},
               273.0, "Jetson AGX Thor: derived from 2070 sparse FP4 TFLOPS"),
)}


def detect_model(device_name: str) -> str:
    """Table key of a CUDA device name ('NVIDIA H200' -> 'h200'); 'unknown' when not in the table."""
    for peak in DEVICE_PEAKS.values():
        if any(m.lower() in device_name.lower() for m in peak.match):
            return peak.name
    return "unknown"


_CPU_PROBE: dict[int, dict[str, float]] = {}


def _best_seconds(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_probe(size: int = 512, copy_mb: int = 64, repeats: int = 5) -> dict[str, float]:
    """Measured CPU peaks: fp32 matmul GFLOP/s and memcpy GB/s (best of `repeats`); cached per process
    and thread count. Takes well under a second."""
    import torch

    threads = torch.get_num_threads()
    if threads not in _CPU_PROBE:
        a, b = torch.randn(size, size), torch.randn(size, size)
        src = torch.ones(copy_mb * 2**20 // 4)
        dst = torch.empty_like(src)
        matmul_s = _best_seconds(lambda: torch.mm(a, b), repeats)
        copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
        _CPU_PROBE[threads] = {"fp32_gflops": 2 * size**3 / matmul_s / 1e9,
                               "memcpy_gbs": 2 * src.nbytes / copy_s / 1e9, "threads": threads}
    return dict(_CPU_PROBE[threads])


def device_peak(device: str, precision: str) -> dict[str, Any]:
    """{'name', 'tflops', 'bandwidth_gbs', 'source'} for the device in use (measured on the CPU)."""
    if not device.startswith("cuda"):
        probe = cpu_probe()
        return {"name": "cpu", "tflops": probe["fp32_gflops"] / 1e3, "bandwidth_gbs": probe["memcpy_gbs"],
                "source": f"measured here: {probe['threads']} threads, fp32 matmul and memcpy probes"}
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    peak = DEVICE_PEAKS.get(detect_model(name))
    if peak is None:
        return {"name": name, "tflops": None, "bandwidth_gbs": None, "source": "not in the table"}
    return {"name": peak.name, "tflops": peak.peak_tflops(precision), "bandwidth_gbs": peak.bandwidth_gbs,
            "source": peak.source}


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def roofline(flops: float, nbytes: float, seconds: float, peak: dict[str, Any]) -> dict[str, Any]:
    """Achieved throughput of one call taking `seconds`, its fraction of `peak`, and the bound."""
    achieved_tflops = flops / seconds / 1e12 if seconds > 0 else None
    achieved_gbs = nbytes / seconds / 1e9 if seconds > 0 else None
    intensity = _div(flops, nbytes)
    ridge = _div(peak["tflops"] * 1e12 if peak["tflops"] else None, (peak["bandwidth_gbs"] or 0) * 1e9)
    bound = None if intensity is None or ridge is None else ("compute" if intensity >= ridge else "memory")
    return {"flops_per_call": flops, "bytes_per_call": nbytes, "seconds_per_call": seconds,
            "achieved_tflops": achieved_tflops, "achieved_gbs": achieved_gbs,
            "compute_fraction": _div(achieved_tflops, peak["tflops"]),
            "bandwidth_fraction": _div(achieved_gbs, peak["bandwidth_gbs"]),
            "intensity_flop_per_byte": intensity, "ridge_flop_per_byte": ridge, "bound": bound,
            "peak": peak}
