"""Value checks applied to every weight at load: finite values, and no implicit cast across dtype kinds.

`WeightMap.apply` (and so `load_module`, every family's loading path) runs both on every tensor it
produces, and reports failures with the other mapping problems in one CheckpointError:

- Finiteness. A NaN or inf anywhere in a float weight makes every output NaN (or, through a
  discretization, finite and wrong). `first_nonfinite` scans a tensor in chunks with ``aminmax`` (a
  reduction that propagates NaN and keeps inf, so no temporary of the tensor's size is made); the
  cost is one read of the weights at memory speed (docs/benchmarks/runtime.md gives the figure at Pi0 size).
  The scan runs on the tensor after its cast, so a float32 value that overflows float16 is caught too.
- Dtype kinds. The loader casts each tensor to its slot's dtype; a cast that changes the *kind* (bool,
  integer, 8-bit float, float, complex) is refused unless the weight-map rule asks for it with
  ``Rule(dtype=...)``: an integer or bool tensor in a float slot is a wrong file, not a weight, and an
  fp8 tensor cast to a float slot without its scales silently drops the scale. The kind of every
  source is checked as well as the produced tensor's (a transform's float math launders kinds).
"""

from __future__ import annotations

import torch

__all__ = ["dtype_kind", "kind_problem", "first_nonfinite", "FINITE_CHUNK"]

FINITE_CHUNK = 1 << 22  # elements per aminmax call: runs at memory speed, stops early on a bad chunk


def dtype_kind(dtype: torch.dtype) -> str:
    """'bool', 'int', 'fp8' (any 8-bit float), 'float' or 'complex'."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "fp8" if dtype.itemsize == 1 else "float"
    return "int"


_KIND_HINTS = {
    ("fp8", "float"): "an fp8 tensor needs its scales to become a float weight; refusing to cast it",
    ("float", "fp8"): "a float tensor must be quantized with scales to fill an fp8 slot; refusing to cast it",
}


def kind_problem(got: torch.dtype, want: torch.dtype) -> str | None:
    """Why an implicit cast ``got -> want`` is refused, or None when both are the same kind."""
    have, need = dtype_kind(got), dtype_kind(want)
    if have == need:
        return None
    hint = _KIND_HINTS.get((have, need), f"a {have} tensor in a {need} slot is the wrong tensor; "
                           "refusing to cast it")
    return f"checkpoint dtype {got}, slot dtype {want}: {hint}"


def first_nonfinite(t: torch.Tensor, chunk: int = FINITE_CHUNK) -> int | None:
    """Flat index of the first NaN/inf element of a float tensor (None when all are finite, t is not a
    float tensor, or t is on the meta device, which holds no values). One streamed pass; the exact
    index is found only inside the failing chunk."""
    if not t.is_floating_point() or t.numel() == 0 or t.is_meta:
        return None
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        if part.dtype.itemsize == 1:  # aminmax has no 8-bit float kernels
            part = part.float()
        lo, hi = torch.aminmax(part)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            return start + int((~torch.isfinite(part)).nonzero()[0, 0])
    return None


def describe_nonfinite(t: torch.Tensor, index: int) -> str:
    """``"nan at [2, 7]"``: the value and its position in ``t``."""
    value = t.detach().reshape(-1)[index].float().item()
    pos = list(torch.unravel_index(torch.tensor(index), t.shape)) if t.dim() else []
    return f"{value} at {[int(p) for p in pos]}"
