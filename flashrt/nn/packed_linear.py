"""Linear maps on oneDNN-packed weights with a fused epilogue, for small GEMMs on the CPU.

Why: on the dev CPU (AMD EPYC, AVX-512) torch's plain float32 GEMM (`F.linear`, a 1x1 `conv1d`) runs at
about half of oneDNN's packed one: the weight is reordered on every call, which at a few hundred rows is
most of the call (docs/benchmarks/tts.md, "Measurements behind the code"). A `PackedLinear` reorders the
weight once (`torch.ops.mkldnn._reorder_linear_weight`; one layout for every row count, unlike the
packed conv weights, whose layout oneDNN picks per input size) and runs `_linear_pointwise` with the
activation or the residual add fused into the GEMM's epilogue.

Runs the packed form on CPU float32 weights where oneDNN is built in; anything else (another dtype, a
GPU) runs the same math unfused (`F.linear`, then the activation or the add). The packed weight is derived
state: rebuild the `PackedLinear` when the source weight changes. Export (`flashrt.runtime.onnx_export`)
records the fused ops as their aten compositions. Under `torch.jit.trace` (the `jit` graph backend) the
packed call goes through a TorchScript function (`traceable`): the tracer cannot record the op's empty
``Scalar?[]`` argument itself, and records a call of the function instead (same op, same values).

Shape legend: M rows (time steps), K inputs, N outputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PackedLinear", "ACTIVATIONS", "traceable"]

_MK = getattr(torch.ops, "mkldnn", None) if torch.backends.mkldnn.is_available() else None
_LINEAR = getattr(_MK, "_linear_pointwise", None)
_REORDER = getattr(_MK, "_reorder_linear_weight", None)

ACTIVATIONS = {"none": lambda y: y, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu}

_TRACEABLE = """
def linear(x: Tensor, w: Tensor, b: Optional[Tensor], act: str) -> Tensor:
    scalars: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x, w, b, act, scalars, "")

def linear_add(x: Tensor, other: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, other, w, b, "add")
"""


@functools.cache
def traceable() -> Any:
    """The packed calls as TorchScript functions (``linear``, ``linear_add``), compiled once on first use:
    what a `torch.jit.trace` records in their place (module docstring)."""
    return torch.jit.CompilationUnit(_TRACEABLE)


class PackedLinear:
    """y = act(x @ weight.T + bias) (``act`` one of `ACTIVATIONS`), or with ``other`` given,
    y = x @ weight.T + bias + other (no activation: oneDNN's binary epilogue takes none).

    weight (N, K), bias (N,) or None; x (M, K) contiguous, other (M, N) -> (M, N), a fresh tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none") -> None:
        if act not in ACTIVATIONS:
            raise ValueError(f"PackedLinear: act {act!r} is not one of {sorted(ACTIVATIONS)}")
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.act = act
        usable = (_LINEAR is not None and _REORDER is not None and self.weight.device.type == "cpu"
                  and self.weight.dtype == torch.float32)
        self.packed = _REORDER(self.weight, 64) if usable else None

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy packs its own weight (oneDNN's packed tensors have no storage to copy)."""
        bias = None if self.bias is None else self.bias.clone()
        return PackedLinear(self.weight.clone(), bias, self.act)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``bias`` replaces the stored bias for this call (a per-call constant folded into it)."""
        b = self.bias if bias is None else bias
        if other is not None and self.act != "none":
            raise ValueError("PackedLinear: a residual add takes no activation")
        if self.packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            if torch.jit.is_tracing():
                fns = traceable()
                return fns.linear(x, self.packed, b, self.act) if other is None else \
                    fns.linear_add(x, other, self.packed, b)
            if other is None:
                return _LINEAR(x, self.packed, b, self.act, [], "")
            return _LINEAR.binary(x, other, self.packed, b, "add")
        y = F.linear(x, self.weight, b)
        return ACTIVATIONS[self.act](y) if other is None else y.add_(other)
