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
* ``torch.nn.functional.scaled_dot_product_attention`` is counted by what torch's CUDA build does with
  these inputs (`sdpa_backend`, `sdpa_launches`): the first backend of the priority (``sdpa``, a
  family's pinned `flashrt.runtime.numerics.Numerics.sdpa`; else `SDPA_PRIORITY`: flash, efficient,
  math) that takes the call, then that backend's launches:

  - flash (no mask, float16/bfloat16, q/k/v head dims equal and <= 256, the same batch and heads unless
    ``enable_gqa``, last dims dense): ONE kernel, plus 2 (a fill and a copy: ``constant_pad_nd``) for
    each of q, k, v whose head dim is not a multiple of 8 (torch pads it, per call);
  - memory-efficient (float16/bfloat16/float32, head dims multiples of 8, the same batch and heads,
    last dims dense; any additive or boolean mask): ONE kernel, plus 2 to turn a boolean mask into a
    bias (a scalar fill and a ``where``), plus 2 (fill + copy) when the bias is not aligned -- a stride
    of a dim before the last that is not a multiple of 8 (`BIAS_ALIGN`), or a last dim that is not
    dense: torch then pads the bias on EVERY call (its ``preprocess_mask``). A (B, 1, 1, S) bias whose
    rows are S apart is unaligned unless S is a multiple of 8; slicing the key dim keeps the row stride,
    so a bias allocated with rows padded to a multiple of 8 never is (`flashrt.nn.attention`);
  - math (whatever no fused backend takes, e.g. a mask with grouped queries): its decomposition as the
    dispatcher runs it on the counting device (matmuls, softmax, the mask add, ...), op by op;
  - cuDNN is not modelled: a priority naming it is read without it.

  A fused backend's output comes back in its memory layout, (B, L, H, D) behind the (B, H, L, D) shape,
  so a following ``transpose(1, 2).reshape`` is a view there as on a GPU. Not counted: flash-attn's
  split-K/V combine kernel, which its heuristic may add on short batches depending on the GPU's SM count
  (the count depends on the inputs only, never on the device model);
* ``torch.nn.functional.rms_norm`` (and ``torch.rms_norm``) is ONE kernel, ``aten._fused_rms_norm``
  (plus a copy for a non-contiguous input), where torch's CUDA build runs its fused kernel: a real
  input that is not channels-last, with no weight or one of the input's dtype; otherwise (and on the
  counting device, which lacks that kernel) its decomposition, op by op;
* a custom op (e.g. ``flashrt::rms_norm``) is one kernel: the dispatcher hands it to the counter as
  one op, whatever its implementation runs inside -- given its CUDA forms (``custom`` of
  `count_kernels`: op name -> (whether the kernel takes the call, the reference); the csrc ones are
  `flashrt.ops.csrc_ops.CUDA_FORMS`), only when its kernel takes the call's shapes, dtypes and
  layouts; otherwise its reference runs, which is counted op by op.

Stages (``stages`` of `count_kernels`): name -> modules; a kernel counts toward the innermost stage
whose module's ``forward`` is running (called through the module or directly), ``"other"`` outside
every one, in ``KernelCount.by_stage``. The fused share is the kernels of ``flashrt::`` custom ops
(``KernelCount.fused``) over the total.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ALLOCATION_ONLY", "ATTENTION", "BIAS_ALIGN", "SDPA_PRIORITY", "KernelCount", "KernelCounter",
           "AllocationCounter", "bias_aligned", "count_kernels", "is_kernel", "sdpa_backend", "sdpa_launches"]

ALLOCATION_ONLY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
ATTENTION = "sdpa"  # the prefix the fused attention kernels are counted under: "sdpa.flash", ...
SDPA_PRIORITY = ("flash", "efficient", "math")  # for a family that pins none: torch's order of these three
BIAS_ALIGN = 8  # memory-efficient attention pads a bias whose strides are not multiples of this (elements)
FUSED_PREFIX = "flashrt."  # op names of the flashrt:: custom ops ("flashrt.rms_norm.default")
OTHER = "other"  # the stage of kernels outside every named stage


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


# ------------------------------------------------------------------------------ SDPA on a CUDA build
def _dense_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """4-d q, k, v with dense last dims, one batch, and one head count (k's may divide q's under gqa)."""
    if any(t.dim() != 4 or t.stride(-1) != 1 for t in (q, k, v)):
        return False
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    heads_q, heads_k = q.shape[1], k.shape[1]
    return heads_k == v.shape[1] and (heads_q == heads_k or (gqa and heads_q % heads_k == 0))


def _flash_takes(q, k, v, mask, gqa: bool) -> bool:
    d = q.shape[-1]
    return (mask is None and q.dtype in (torch.float16, torch.bfloat16) and d == k.shape[-1] == v.shape[-1]
            and d <= 256 and _dense_heads(q, k, v, gqa))


def _efficient_takes(q, k, v, mask, gqa: bool) -> bool:
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] == k.shape[-1]
            and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0 and _dense_heads(q, k, v, False))


SDPA_TAKES = {"flash": _flash_takes, "efficient": _efficient_takes, "math": lambda *_: True}


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 priority: Sequence[str] = SDPA_PRIORITY, gqa: bool = False) -> str:
    """The backend torch's CUDA build runs this call with: the first of ``priority`` that takes it
    (module docstring); "math" when none does. cuDNN is not modelled (skipped)."""
    for name in priority:
        if name in SDPA_TAKES and SDPA_TAKES[name](q, k, v, mask, gqa):
            return name
    return "math"


def bias_aligned(bias: torch.Tensor) -> bool:
    """Whether memory-efficient attention takes ``bias`` as it is: every stride before the last a
    multiple of `BIAS_ALIGN`, the last dim dense (else torch pads it, per call)."""
    return bias.stride(-1) == 1 and all(s % BIAS_ALIGN == 0 for s in bias.stride()[:-1])


def sdpa_launches(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None = None) -> dict[str, int]:
    """Kernels of one fused SDPA call by name (module docstring); {} for "math" (counted op by op)."""
    if backend == "flash":
        pads = sum(t.shape[-1] % 8 != 0 for t in (q, k, v))
        return {f"{ATTENTION}.flash": 1, **({f"{ATTENTION}.flash pad head dim": 2 * pads} if pads else {})}
    if backend != "efficient":
        return {}
    out = {f"{ATTENTION}.efficient": 1}
    if mask is not None and mask.dtype == torch.bool:
        out[f"{ATTENTION}.efficient bool mask to bias"] = 2
        mask = torch.empty(mask.shape, device="meta")  # the converted bias: a fresh contiguous tensor
    if mask is not None and not bias_aligned(mask):
        out[f"{ATTENTION}.efficient pad bias"] = 2
    return out


def _sdpa_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, bool]:
    q, k, v = args[:3]
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return q, k, v, mask, bool(kwargs.get("enable_gqa", False))


@dataclass
class KernelCount:
    """The kernels one run launched: ``total``, the count per op name (``aten.mm.default``, ...) and per
    stage (`count_kernels`' ``stages``; ``"other"`` outside them)."""

    total: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_stage: Counter = field(default_factory=Counter)

    def add(self, name: str, n: int = 1, stage: str = OTHER) -> None:
        self.total += n
        self.by_op[name] += n
        self.by_stage[stage] += n

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        return self.by_op.most_common(n)

    @property
    def fused(self) -> int:
        """Kernels of the ``flashrt::`` custom ops (one fused kernel each on a CUDA build with csrc)."""
        return sum(n for op, n in self.by_op.items() if op.startswith(FUSED_PREFIX))

    @property
    def fused_share(self) -> float:
        return self.fused / self.total if self.total else 0.0

    def to_dict(self, top: int = 12) -> dict[str, Any]:
        """{"total", "top"}: what bench results carry (their schema)."""
        return {"total": self.total, "top": dict(self.top(top))}

    def report(self, top: int = 12) -> dict[str, Any]:
        """`to_dict` plus the fused kernels, their share and the split by stage (`flashrt kernels`)."""
        return {"total": self.total, "fused": self.fused, "fused_share": round(self.fused_share, 4),
                "stages": dict(self.by_stage), "top": dict(self.top(top))}


def _fused_rms_norm_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether torch's CUDA build runs ``rms_norm(x, ..., weight)`` as its one fused kernel."""
    channels_last = x.dim() in (4, 5) and not x.is_contiguous() and (
        x.is_contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d))
    return not x.is_complex() and not channels_last and (weight is None or weight.dtype == x.dtype)


RMS_NORMS = (F.rms_norm, torch.rms_norm)
FUSED_RMS_NORM = "aten._fused_rms_norm"


class _CudaComposites(TorchFunctionMode):
    """Counts the composites that a CUDA build runs as fused kernels (scaled_dot_product_attention by
    its backend, rms_norm; module docstring) by those kernels, and hides their decomposition on the
    counting device."""

    def __init__(self, counter: KernelCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.hidden:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, gqa = _sdpa_inputs(args, kwargs)
            backend = sdpa_backend(q, k, v, mask, self.counter.sdpa, gqa)
            if backend == "math":
                return func(*args, **kwargs)  # the decomposition is the work: counted op by op
            launches = sdpa_launches(backend, q, k, v, mask)
        elif func in RMS_NORMS and _fused_rms_norm_takes(args[0], kwargs.get("weight", _arg(args, 2))):
            launches = {FUSED_RMS_NORM: 1 + int(not args[0].is_contiguous())}
        else:
            return func(*args, **kwargs)
        for name, n in launches.items():
            self.counter.add(name, n)
        return self._hidden(func, args, kwargs)

    def _hidden(self, func, args, kwargs):
        self.counter.hidden += 1
        try:
            out = func(*args, **kwargs)
            if func is F.scaled_dot_product_attention and out.dim() == 4:  # the fused kernels' layout
                return out.transpose(1, 2).contiguous().transpose(1, 2)
            return out
        finally:
            self.counter.hidden -= 1


def _arg(args: tuple, i: int) -> Any:
    return args[i] if len(args) > i else None


class KernelCounter(TorchDispatchMode):
    """Counts the kernels of everything run inside ``with counter:`` into ``counter.count``; attention by
    the ``sdpa`` backend priority, kernels by the innermost running module of ``stages``."""

    def __init__(self, sdpa: Sequence[str] | None = None,
                 stages: Mapping[str, Sequence[torch.nn.Module]] | None = None,
                 custom: Mapping[str, tuple[Callable[..., bool], Callable[..., Any]]] | None = None) -> None:
        super().__init__()
        self.custom = dict(custom or {})
        self.count = KernelCount()
        self.hidden = 0
        self.sdpa = tuple(sdpa) if sdpa else SDPA_PRIORITY
        self.stages = dict(stages or {})
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._attention = _CudaComposites(self)

    def add(self, name: str, n: int = 1) -> None:
        self.count.add(name, n, self._stack[-1] if self._stack else OTHER)

    def _hook_stages(self) -> None:
        """Wrap each stage module's ``forward`` (an instance attribute, so direct ``.forward`` calls, which
        the hot paths use to skip ``__call__``, are seen too); `_unhook_stages` restores it."""
        for name, modules in self.stages.items():
            for module in modules:
                self._hooks.append((module, module.__dict__.get("forward")))
                module.forward = self._staged(name, module.forward)

    def _staged(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(name)
            try:
                return forward(*args, **kwargs)
            finally:
                self._stack.pop()

        return run

    def _unhook_stages(self) -> None:
        for module, own in reversed(self._hooks):
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._hooks.clear()
        self._stack.clear()

    def __enter__(self) -> KernelCounter:
        self._hook_stages()
        self._attention.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._attention.__exit__(None, None, None)
            self._unhook_stages()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            try:
                self._attention.__exit__(*exc)
            finally:
                self._unhook_stages()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        form = self.custom.get(str(func))
        if form is not None and not self.hidden and not form[0](*args, **kwargs):
            return self._reference(form[1], args, kwargs)
        out = func(*args, **kwargs)
        if not self.hidden and is_kernel(func, args, kwargs, out):
            self.add(str(func))
        return out

    def _reference(self, reference: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A custom op whose kernel does not take the call: its reference, counted op by op."""
        inner = KernelCounter(self.sdpa, custom=self.custom)
        with inner:
            out = reference(*args, **kwargs)
        for name, n in inner.count.by_op.items():
            self.add(name, n)
        return out


def count_kernels(fn: Callable[[], Any], sdpa: Sequence[str] | None = None,
                  stages: Mapping[str, Sequence[torch.nn.Module]] | None = None,
                  custom: Mapping[str, tuple[Callable[..., bool], Callable[..., Any]]] | None = None,
                  ) -> KernelCount:
    """Run ``fn()`` once under no_grad and a `KernelCounter`; the kernels it launched. ``sdpa``: the
    attention backends in priority order (a family's pinned ones; torch's CUDA order by default);
    ``stages``: name -> modules whose kernels are counted under that name; ``custom``: the custom ops'
    CUDA forms (module docstring)."""
    counter = KernelCounter(sdpa, stages, custom)
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
