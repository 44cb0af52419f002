"""The `trace` graph backend: a CPU stand-in for a CUDA graph that keeps the graph rules honest.

Capture runs fn once, for real, under two recorders:

* a TorchFunctionMode that sees Python-level tensor calls which never reach the dispatcher
  (`.cpu()` of a CPU tensor, `.tolist()`, `.numpy()`, `bool(t)`, printing) and factory calls whose
  size is a tensor (`torch.arange(t.max())`);
* a TorchDispatchMode that records every aten op with its arguments and refuses what a CUDA graph
  cannot hold: host syncs (`_local_scalar_dense`, `equal`), data-dependent shapes (`nonzero`,
  boolean-mask indexing, `masked_select`, `unique`, `bincount`, `repeat_interleave` without
  `output_size`), RNG ops, host<->device copies, and in-place ops that reallocate a static tensor.

A refusal is a `CaptureRefused` (a CaptureError) naming the op and the innermost source line outside
torch and this module, i.e. the user's code that called it. Not seen by the recorder (it only sees
tensor ops): `torch.cuda.synchronize()`, work on other streams or threads, non-torch side effects.

The recorded program is a list of aten calls. Tensors produced inside fn (intermediates) become
slots, recomputed on every replay and released after their last use. Every other tensor fn touched
(buffers, weights, constants created from Python literals) is held by reference: replay reads their
*current* contents, so writing new inputs into the buffers between replays is seen, and in-place
writes / `out=` / slice assignment into static outputs and caches land in the same storage. Replay
runs the same aten ops on the same tensors as eager, hence results equal eager bit for bit.

Ownership and lifetime: a TraceGraph belongs to whoever captured it and keeps its static tensors
alive. It is valid while those tensors keep their storage (see `flashrt.runtime.graphs`); the named
buffers are checked on every replay. Python side effects of fn, Python values (ints, flags) and
tensor constants created inside fn are frozen at capture. Capture and replay run under no_grad.
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from flashrt.errors import CaptureError
from flashrt.runtime.graphs import BufferGuard, named_tensors

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------------------------
# Refusals: what, why, and the source line of the user's code that did it.


class CaptureRefused(CaptureError):
    """Trace capture refused an op a CUDA graph cannot hold. `.op` names it, `.location` is file:line."""

    def __init__(self, op: str, reason: str, fix: str, location: str, source: str = "") -> None:
        self.op, self.reason, self.location = op, reason, location
        where = f"{location}\n    {source}" if source else location
        super().__init__(f"cannot capture {op} at {where}\n{reason}. Fix: {fix}")


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_TORCH_DIR) or path == _HERE or filename.startswith("<frozen")


def user_location() -> tuple[str, str]:
    """("file:line", source text) of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", ""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return f"{filename}:{line}", linecache.getline(filename, line).strip()


@dataclass(frozen=True)
class Rule:
    """Why an op is refused and what to do instead."""

    reason: str
    fix: str

    def refuse(self, op: str) -> CaptureRefused:
        return CaptureRefused(op, self.reason, self.fix, *user_location())


HOST_SYNC = Rule(
    "it reads a tensor value on the host (a device->host sync), which a CUDA graph cannot contain",
    "keep the value on the device (torch.where, masks, clamp) or read it outside the captured fn",
)
BRANCH = Rule(
    "a Python branch on a tensor value (if/while/and/or/assert on a tensor) reads it on the host; "
    "the graph would freeze whichever branch was taken at capture",
    "compute both sides and select with torch.where, or move the decision outside the captured fn",
)
PRINT = Rule("printing a tensor reads its values on the host", "remove the print from the captured fn")
DATA_ALLOC = Rule(
    "an allocation whose size depends on tensor values changes shape from call to call",
    "allocate at a static (bucket) size and mask the unused part",
)
DATA_SHAPE = Rule(
    "its output shape depends on tensor values (and needs a host sync to size it)",
    "use a static-size formulation: masks with torch.where / masked_fill, nonzero_static, "
    "or pass output_size",
)
RNG = Rule(
    "random ops inside a graph replay a fixed stream or none at all",
    "draw the randomness outside and let it enter through a static input buffer (e.g. noise=)",
)
COPY = Rule(
    "a host<->device copy inside the graph syncs (device->host) or bakes a host address (host->device)",
    "copy inputs in with Buffers.populate before replay and read outputs after it",
)
REALLOC = Rule(
    "it resized or re-pointed a static tensor; the graph would keep using the old storage",
    "write into static buffers with copy_/out= of the exact shape; never resize_ or set_ them",
)

_FUNCTION_RULES: dict[Any, tuple[str, Rule]] = {
    torch.Tensor.item: (".item()", HOST_SYNC),
    torch.Tensor.tolist: (".tolist()", HOST_SYNC),
    torch.Tensor.numpy: (".numpy()", HOST_SYNC),
    torch.Tensor.cpu: (".cpu()", HOST_SYNC),
    torch.Tensor.__bool__: ("bool(tensor)", BRANCH),
    torch.Tensor.__int__: ("int(tensor)", HOST_SYNC),
    torch.Tensor.__float__: ("float(tensor)", HOST_SYNC),
    torch.Tensor.__complex__: ("complex(tensor)", HOST_SYNC),
    torch.Tensor.__index__: ("tensor used as a Python index (__index__)", HOST_SYNC),
    torch.Tensor.__repr__: ("repr(tensor)", PRINT),
    torch.Tensor.__str__: ("str(tensor)", PRINT),
    torch.Tensor.__format__: ("format(tensor)", PRINT),
}

_FACTORIES = {
    f: f"torch.{f.__name__}"
    for f in (torch.arange, torch.range, torch.linspace, torch.logspace, torch.zeros, torch.ones,
              torch.empty, torch.full, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm)
}
_FACTORIES.update({
    f: f"Tensor.{f.__name__}"
    for f in (torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full)
})

_HOST_SYNC_OPS = {"_local_scalar_dense", "equal", "is_nonzero"}
_DATA_SHAPE_OPS = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                   "unique_dim_consecutive", "bincount"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index",
              "_unsafe_index_put"}
_REPOINTING_OPS = {"resize_", "resize_as_", "set_"}


def _has_tensor(values: Sequence[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in tree_leaves(list(values)))


def check_function(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Refuse Python-level tensor calls a CUDA graph cannot hold (TorchFunctionMode level)."""
    entry = _FUNCTION_RULES.get(func)
    if entry is not None:
        raise entry[1].refuse(entry[0])
    name = _FACTORIES.get(func)
    if name is not None:
        sizes = args[1:] if name.startswith("Tensor.") else args
        size_kwargs = [v for k, v in kwargs.items() if k != "out"]
        if _has_tensor([*sizes, *size_kwargs]):
            raise DATA_ALLOC.refuse(f"{name} with a tensor-valued size")


def _bool_index(args: Sequence[Any]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _device_crossing(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if name == "copy_":
        return args[0].device != args[1].device
    if name == "_to_copy" and kwargs.get("device") is not None:
        return torch.device(kwargs["device"]).type != args[0].device.type
    return False


def _bound(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    schema_args = func._schema.arguments
    bound = {a.name: a.default_value for a in schema_args if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(schema_args, args)})
    bound.update(kwargs)
    return bound


def _draws_random(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Seeded ops draw unless their dropout is off (attention kernels carry a dropout_p argument)."""
    bound = _bound(func, args, kwargs)
    if "dropout_p" in bound:
        return bool(bound["dropout_p"])
    return bool(bound.get("train", True))


def check_op(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Refuse aten ops a CUDA graph cannot hold (TorchDispatchMode level)."""
    name = func.overloadpacket.__name__
    if name in _HOST_SYNC_OPS:
        raise HOST_SYNC.refuse(f"aten.{name}")
    if name in _DATA_SHAPE_OPS:
        raise DATA_SHAPE.refuse(f"aten.{name}")
    if name in _INDEX_OPS and _bool_index(args):
        raise DATA_SHAPE.refuse(f"boolean-mask indexing (aten.{name} with a bool index)")
    if name == "repeat_interleave" and kwargs.get("output_size") is None and _has_tensor(args):
        raise DATA_SHAPE.refuse("aten.repeat_interleave without output_size")
    if torch.Tag.nondeterministic_seeded in func.tags and _draws_random(func, args, kwargs):
        raise RNG.refuse(f"aten.{name} (random)")
    if _device_crossing(name, args, kwargs):
        raise COPY.refuse(f"aten.{name} across devices")


# ----------------------------------------------------------------------------------------------
# The recorded program.


@dataclass(frozen=True)
class Step:
    """One recorded aten call. `reads`: (leaf position, slot); `writes`: (output leaf, slot)."""

    func: torch._ops.OpOverload
    spec: TreeSpec
    leaves: tuple[Any, ...]
    reads: tuple[tuple[int, int], ...]
    writes: tuple[tuple[int, int], ...]
    release: tuple[int, ...] = ()

    def run(self, env: list[Any]) -> None:
        leaves = list(self.leaves)
        for pos, slot in self.reads:
            leaves[pos] = env[slot]
        args, kwargs = tree_unflatten(leaves, self.spec)
        out = self.func(*args, **kwargs)
        if self.writes:
            outs = tree_leaves(out)
            for pos, slot in self.writes:
                env[slot] = outs[pos]
        for slot in self.release:
            env[slot] = None


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (e.g. some subclasses)
        return 0


class Recorder:
    """Turns the ops seen during capture into Steps; tracks which tensors are intermediates."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.steps: list[Step] = []
        self.slot_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.statics: dict[int, torch.Tensor] = {}
        self.nslots = 0

    def label(self, t: torch.Tensor) -> str:
        return self.names.get(id(t), f"static tensor {tuple(t.shape)} {t.dtype}")

    def _reference(self, pos: int, leaf: Any, reads: list[tuple[int, int]]) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        slot = self.slot_of.get(leaf)
        if slot is None:
            self.statics.setdefault(id(leaf), leaf)
            return leaf
        reads.append((pos, slot))
        return None

    def _bind_outputs(self, out: Any) -> tuple[tuple[int, int], ...]:
        writes = []
        for pos, leaf in enumerate(tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                self.slot_of[leaf] = self.nslots
                writes.append((pos, self.nslots))
                self.nslots += 1
        return tuple(writes)

    def inputs(self, leaves: list[Any]) -> tuple[tuple[Any, ...], tuple[tuple[int, int], ...]]:
        """Classify an op's argument leaves before it runs: constants/statics kept, slots read."""
        reads: list[tuple[int, int]] = []
        kept = tuple(self._reference(pos, leaf, reads) for pos, leaf in enumerate(leaves))
        return kept, tuple(reads)

    def record(self, func: Any, spec: TreeSpec, inputs: tuple, out: Any) -> None:
        kept, reads = inputs
        self.steps.append(Step(func, spec, kept, reads, self._bind_outputs(out)))

    def program(self) -> list[Step]:
        """The steps with release lists: each slot is dropped right after its last use."""
        last: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for _, slot in (*step.writes, *step.reads):
                last[slot] = i
        release: dict[int, list[int]] = {}
        for slot, i in last.items():
            release.setdefault(i, []).append(slot)
        return [Step(s.func, s.spec, s.leaves, s.reads, s.writes, tuple(sorted(release.get(i, ()))))
                for i, s in enumerate(self.steps)]


def _written_statics(func: Any, leaves: list[Any], recorder: Recorder) -> list[torch.Tensor]:
    if not func._schema.is_mutable:
        return []
    return [t for t in leaves if isinstance(t, torch.Tensor) and id(t) in recorder.statics]


def _layout(t: torch.Tensor) -> tuple:
    if t.is_mkldnn:  # a oneDNN-packed weight (read-only operand of a mutable op): no storage, no strides
        return (id(t), tuple(t.shape))
    return (_storage_ptr(t), t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_op(func, args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = self.recorder.inputs(leaves)
        written = _written_statics(func, leaves, self.recorder)
        name = func.overloadpacket.__name__
        if written and name in _REPOINTING_OPS:
            raise REALLOC.refuse(f"aten.{name} on {self.recorder.label(written[0])}")
        before = [_layout(t) for t in written]
        out = func(*args, **kwargs)
        for t, layout in zip(written, before):
            if _layout(t) != layout:
                raise REALLOC.refuse(f"aten.{name} on {self.recorder.label(t)}")
        self.recorder.record(func, spec, inputs, out)
        return out


class _FunctionChecker(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_function(func, args, kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Graph and backend.


class TraceGraph:
    """A recorded aten program replayed against the static tensors it was captured with."""

    backend = "trace"

    def __init__(self, steps: list[Step], nslots: int, guard: BufferGuard | None) -> None:
        self.steps = steps
        self.nslots = nslots
        self._guard = guard

    def replay(self, times: int = 1) -> None:
        if self._guard is not None:
            self._guard.check()
        env: list[Any] = [None] * self.nslots
        with torch.no_grad():
            for _ in range(times):
                for step in self.steps:
                    step.run(env)

    def check(self) -> None:
        if self._guard is not None:
            self._guard.check()

    def __len__(self) -> int:
        return len(self.steps)

    def op_names(self) -> list[str]:
        """The recorded aten ops in order, e.g. ["aten.addmm.default", "aten.copy_.default"]."""
        return [str(step.func) for step in self.steps]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for name in self.op_names():
            counts[name] = counts.get(name, 0) + 1
        top = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])[:8])
        return f"trace graph: {len(self.steps)} ops, {self.nslots} intermediates; {top}"


class TraceBackend:
    """Record at capture, refuse what a CUDA graph cannot hold, replay the program bit for bit."""

    name = "trace"

    def __init__(self, check_buffers: bool = True) -> None:
        self.check_buffers = check_buffers

    def capture(self, fn: Callable[[], Any], buffers: Any = None) -> TraceGraph:
        if not callable(fn):
            raise CaptureError(f"capture needs a no-argument callable, got {type(fn).__name__}")
        names = {id(t): f"buffer {n!r}" for n, t in named_tensors(buffers).items()}
        recorder = Recorder(names)
        with torch.no_grad(), _FunctionChecker(), _DispatchRecorder(recorder):
            fn()
        guard = BufferGuard(buffers) if self.check_buffers and buffers is not None else None
        return TraceGraph(recorder.program(), recorder.nslots, guard)
