"""Quantization: precision specs, reference fp8/int8 ops, calibration and the calibration cache.

    precision.py  PrecisionSpec / TensorSpec (pure data, presets, device validation)
    ops.py        CPU-runnable reference ops: amax, compute_scale, quantize, dequantize, fake_quant_linear
    calibrate.py  amax collection with forward hooks, percentile reduction, recipes (calibration/*.toml)
    cache.py      CalibrationCache: verified, atomically written safetensors entries keyed by CacheKey
    linear.py     QuantWeight: int8 W8A8 / fp8 GEMM weights any F.linear call site runs; kernel table
    flow.py       the loader's flow: cache hit -> install; miss -> calibrate, quality gate, store
    cli.py        `flashrt cache ls|verify|rm` (imported only by the command line)
"""

from flashrt.quant.cache import CacheKey, CalibrationCache, Scales, canonical_json
from flashrt.quant.calibrate import Recipe, calibrate, collect_amax, load_recipe, reduce_amax, samples_digest
from flashrt.quant.ops import (
    amax,
    amax_per_channel,
    amax_per_tensor,
    compute_scale,
    dequantize,
    fake_quant,
    fake_quant_linear,
    quantize,
    quantize_weight,
)
from flashrt.quant.precision import PRESETS, PrecisionSpec, TensorSpec

__all__ = [
    "PRESETS", "CacheKey", "CalibrationCache", "PrecisionSpec", "Recipe", "Scales", "TensorSpec", "amax",
    "amax_per_channel", "amax_per_tensor", "calibrate", "canonical_json", "collect_amax", "compute_scale",
    "dequantize", "fake_quant", "fake_quant_linear", "load_recipe", "quantize",
    "quantize_weight", "reduce_amax", "samples_digest",
]
