"""Quality gate: outputs compared with a reference run before any timing counts.

`compare(out, ref, atol, rtol)` walks both outputs together (tensors, numpy arrays, dicts, lists,
numbers, strings) and reports the worst element against |out - ref| <= atol + rtol * |ref|. A shape,
key or length mismatch fails; non-finite values must sit exactly where the reference has
the same ones (NaN for NaN, +inf for +inf).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class GateResult:
    """Verdict of one comparison: passed, worst absolute error and its place, or why it failed."""

    passed: bool
    max_abs: float = 0.0
    max_excess: float = 0.0
    where: str = ""
    reason: str = ""


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
        return (t.float() if t.is_floating_point() and t.dtype != torch.float64 else t).numpy()
    return np.asarray(x)


def _compare_arrays(out: Any, ref: Any, atol: float, rtol: float, where: str) -> GateResult:
    a, b = _as_numpy(out), _as_numpy(ref)
    if a.shape != b.shape:
        return GateResult(False, where=where, reason=f"shape {a.shape} != reference {b.shape}")
    if a.dtype.kind in "OUS" or b.dtype.kind in "OUS":
        same = bool(np.array_equal(a, b))
        return GateResult(same, where=where, reason="" if same else "values differ")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(b64)
    if not np.isfinite(a64[finite]).all():
        return GateResult(False, where=where, reason="non-finite values where the reference is finite")
    if not np.array_equal(a64[~finite], b64[~finite], equal_nan=True):
        return GateResult(False, where=where, reason="non-finite reference values not reproduced")
    diff = np.abs(a64[finite] - b64[finite])
    excess = (diff - (atol + rtol * np.abs(b64[finite]))) if diff.size else np.zeros(0)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_excess = float(excess.max()) if excess.size else 0.0
    passed = max_excess <= 0.0
    return GateResult(passed, max_abs, max_excess, where,
                      "" if passed else f"max |Δ| {max_abs:.3g} over atol {atol:g} + rtol {rtol:g}·|ref|")


def _worst(results: list[GateResult]) -> GateResult:
    failed = [r for r in results if not r.passed]
    pool = failed or results
    return max(pool, key=lambda r: (r.max_excess, r.max_abs)) if pool else GateResult(True)


def compare(out: Any, ref: Any, atol: float, rtol: float, where: str = "output") -> GateResult:
    """Compare an output with the reference output (see module doc)."""
    if isinstance(ref, Mapping):
        if not isinstance(out, Mapping) or set(out) != set(ref):
            got = sorted(map(str, out)) if isinstance(out, Mapping) else type(out).__name__
            return GateResult(False, where=where, reason=f"keys {got} != reference {sorted(map(str, ref))}")
        return _worst([compare(out[k], ref[k], atol, rtol, f"{where}[{k!r}]") for k in ref])
    if isinstance(ref, list | tuple):
        if not isinstance(out, list | tuple) or len(out) != len(ref):
            return GateResult(False, where=where, reason="length or type differs from the reference")
        return _worst([compare(o, r, atol, rtol, f"{where}[{i}]") for i, (o, r) in enumerate(zip(out, ref))])
    if isinstance(ref, str | bytes) or ref is None:
        return GateResult(out == ref, where=where, reason="" if out == ref else "values differ")
    return _compare_arrays(out, ref, atol, rtol, where)
