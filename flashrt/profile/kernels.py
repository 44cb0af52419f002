"""Kernels per replay, and tensor allocations, counted on any device (the `meta` device included).

A captured step costs, on a GPU, about one launch per kernel (a few microseconds each even inside a CUDA
graph), so the number of kernels one replay launches is a figure to drive down. It is counted here
without a GPU: run the step once under `KernelCounter` (a TorchDispatchMode), usually on the ``meta``
device, which takes the CUDA code path of every op and computes nothing (seconds for a full-size Pi0).

    from flashrt.profile.kernels import count_kernels
    count = count_kernels(step)          # step: the no-argument function a graph backend captures
    count.total, count.by_op.most_common(5)

What counts as one kernel (the rule, applied op by op as the dispatcher sees them):

* an aten op that writes memory: a mutating op (in-place ``add_``, ``copy_``, ``out=`` variants) or an
  op whose outputs are fresh tensors (``mm``, ``addmm``, ``add``, ``_to_copy``, ``clone``, ``cat``, ...);
* NOT counted, because they launch nothing: views and metadata-only ops, i.e. non-mutating ops whose
  every output shares storage with an input (``view``, ``_unsafe_view``, ``reshape`` when it is a
  view, ``expand``, ``as_strided``, ``t``, ``transpose``, ``permute``, ``unsqueeze``, ``squeeze``,
  ``slice``, ``select``, ``split``, ``unbind``, ``detach``, ``alias``, and a ``.to()`` /
  ``.contiguous()`` that returns its input), and allocation-only factories (`ALLOCATION_ONLY`:
  ``empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ``new_empty_strided``);
* ``torch.nn.functional.scaled_dot_product_attention`` is ONE kernel (the fused attention a CUDA build
  runs: flash, memory-efficient or cuDNN), whatever it decomposes into on the counting device (on
  ``meta`` and the CPU it becomes the math path: matmuls, softmax, ...), which is not counted, and
  its output comes back in the fused kernels' memory layout, (B, L, H, D) behind the (B, H, L, D)
  shape, so a following ``transpose(1, 2).reshape`` is a view there as on a GPU;
* a custom op (e.g. ``flashrt::rms_norm``) is one kernel: the dispatcher hands it to the counter as
  one op, whatever its implementation runs inside.

So the count is "aten-level kernels": a GEMM that cuBLAS splits into two launches counts one; that is
the resolution that guides fusion. On a GPU, `torch.profiler` gives the launched count (bench/).

Run the step under ``torch.no_grad()`` (what `count_kernels` does), not ``inference_mode``: there the
dispatcher hands composite ops (``linear``, ``layer_norm``) to the mode undecomposed; the rule above
still counts them right (one kernel each, views by their aliasing), only the op names differ.

`AllocationCounter` (same machinery) counts the tensors given fresh storage: every output of an op
that does not alias an input, ``empty`` included. It is the host-side check that a hot path allocates
a small, size-independent number of tensors per call (`pause()` excludes a region, e.g. the replay).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ALLOCATION_ONLY", "ATTENTION", "KernelCount", "KernelCounter", "AllocationCounter",
           "count_kernels", "is_kernel"]

ALLOCATION_ONLY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
ATTENTION = "scaled_dot_product_attention"  # the name the fused attention is counted under


def _storage(t: torch.Tensor) -> int | None:
    """An id of t's storage; None for tensors without one (oneDNN's opaque layouts): never aliases."""
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (NotImplementedError, RuntimeError):
        return None


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {s for s in map(_storage, tensors) if s is not None}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def fresh_outputs(func: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> list[torch.Tensor]:
    """The outputs of one op call that do not share storage with any of its inputs."""
    inputs = _storages(_tensors((args, kwargs)))
    return [t for t in _tensors(out) if _storage(t) is None or _storage(t) not in inputs]


def is_kernel(func: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> bool:
    """Whether one dispatched op call launches a kernel (module docstring: the rule)."""
    if func.overloadpacket.__name__ in ALLOCATION_ONLY:
        return False
    if func._schema.is_mutable:
        return True
    outputs = _tensors(out)
    return not outputs or bool(fresh_outputs(func, args, kwargs, out))


@dataclass
class KernelCount:
    """The kernels one run launched: ``total`` and the count per op name (``aten.mm.default``, ...)."""

    total: int = 0
    by_op: Counter = field(default_factory=Counter)

    def add(self, name: str, n: int = 1) -> None:
        self.total += n
        self.by_op[name] += n

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        return self.by_op.most_common(n)

    def to_dict(self, top: int = 12) -> dict[str, Any]:
        return {"total": self.total, "top": dict(self.top(top))}


class _Attention(TorchFunctionMode):
    """Counts each scaled_dot_product_attention call as one kernel and hides its decomposition."""

    def __init__(self, counter: KernelCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.counter.hidden:
            return func(*args, **kwargs)
        self.counter.count.add(ATTENTION)
        self.counter.hidden += 1
        try:
            out = func(*args, **kwargs)
            return out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out
        finally:
            self.counter.hidden -= 1


class KernelCounter(TorchDispatchMode):
    """Counts the kernels of everything run inside ``with counter:`` into ``counter.count``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = KernelCount()
        self.hidden = 0
        self._attention = _Attention(self)

    def __enter__(self) -> KernelCounter:
        self._attention.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._attention.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.hidden and is_kernel(func, args, kwargs, out):
            self.count.add(str(func))
        return out


def count_kernels(fn: Callable[[], Any]) -> KernelCount:
    """Run ``fn()`` once under no_grad and a `KernelCounter`; the kernels it launched."""
    counter = KernelCounter()
    with torch.no_grad(), counter:
        fn()
    return counter.count


class AllocationCounter(TorchDispatchMode):
    """Counts tensors given fresh storage (``allocations``) and by op name (``by_op``); ``pause()``
    leaves a region out (e.g. a replay, when counting what a hot path allocates around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations = 0
        self.by_op: Counter = Counter()
        self._paused = 0

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused:
            fresh = len(fresh_outputs(func, args, kwargs, out))
            if fresh:
                self.allocations += fresh
                self.by_op[str(func)] += fresh
        return out
