"""The `jit` graph backend: the step traced once into a TorchScript graph, replayed without Python.

A CPU step of a small model is mostly host overhead: each of its ~250 aten calls goes through Python
(module calls, argument parsing) and hands the GIL back and forth, so the stages of a chain (an LM
stepping, a codec decoding, a server writing) take turns on one interpreter instead of running on
their cores. Capture traces ``fn`` (`torch.jit.trace`) with the named buffers as the graph's
inputs; a replay runs the recorded aten program in TorchScript's interpreter, which releases the GIL
for the whole call: about half the host time of eager per call (a 2-layer 64-wide decode step: 0.8 ->
0.4 ms), and other threads run meanwhile.

What it holds and when it is valid:

* The named buffers are the graph's inputs, passed by reference on every replay: writes into them
  between replays are seen, and in-place writes / ``out=`` / slice assignment land in their storage.
  They are checked on every replay (moved storage: CaptureError, as the other backends).
* Every other tensor ``fn`` touches (weights, tables, constants) is a constant of the graph, frozen at
  capture (the interpreter may fold ops on constants): re-capture after changing a weight. Weights
  must not require grad (CaptureError: freeze the module; the loaders do).
* Two kinds of tensor ``fn`` touches cannot be constants and become extra inputs, held by the graph
  (`extra_operands`): oneDNN-packed weights (`flashrt.nn.packed_linear`; ``is_mkldnn``, no storage: the
  tracer refuses them), and views of the buffers taken before capture (a step built with
  ``out = buffers["y"][:n]`` outside and ``out.copy_(...)`` inside): as constants, reads of them could be
  folded and writes into them were dropped without a word (nothing of the graph reads them back). The
  trace collects them as it goes (a `TorchFunctionMode`: any tensor passed to a torch call that is
  oneDNN-packed, or shares a buffer's storage but was not made during the step), and the step is traced
  again with them as inputs; a trace stopped by a packed weight is followed by one eager run that
  collects them all first.
* Python values and control flow are frozen at capture, as for every backend (`flashrt.runtime.graphs`):
  the tracer's warnings (mostly shape checks, static here) are not shown; a step that reads a tensor's
  value on the host would be frozen silently, so a graph body is checked under the `trace` backend,
  which refuses host syncs.
* ``replay(times)`` runs the step that many times in one call (a scripted loop around the traced
  step): the GIL is released once for the whole block. A thread replaying step by step takes the GIL
  back after every step, and while another thread runs Python it waits up to the switch interval
  (5 ms) each time; the slot decoder replays its blocks this way (`flashrt.runtime.slots`).
* Replays run the interpreter without its executor's optimizing passes (`torch.jit.optimized_execution`
  off, thread-local, for the replay's duration only). With the fusers off those passes gave these steps
  nothing measurable, while the profiling executor must first run each graph twice, several times
  slower than after, which capture paid as warm-ups (the figures: docs/architecture.md and the TTS
  benchmarks page).
* Capture runs ``fn`` for real (the trace), then replays it ``warmup`` more times (default 0): fn's
  effects on its buffers happen ``1 + warmup`` times at capture, as with the `trace` and `cuda` backends
  (up to two more for a step with extra operands: the trace that found them, or the one a packed weight
  stopped and the eager run after it).

Replays run the same aten ops on the same tensors as eager (TorchScript's CPU fusers are off by
default and the other passes do not change values), so results equal eager bit for bit; tests check
it per user (`flashrt.runtime.slots`). CPU only: a CUDA step has CUDA graphs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from flashrt.errors import CaptureError
from flashrt.runtime.graphs import BufferGuard, CaptureFn, named_tensors

__all__ = ["JitBackend", "JitGraph", "extra_operands"]

_OPAQUE_CONSTANT = "Unsupported value kind: Tensor"  # the tracer, meeting a oneDNN-packed constant


class JitGraph:
    """A traced step over its named buffers (module docstring)."""

    backend = "jit"

    def __init__(self, loop: Any, inputs: list[torch.Tensor], guard: BufferGuard) -> None:
        self._loop, self._inputs, self._guard = loop, inputs, guard

    def replay(self, times: int = 1) -> None:
        """Run the step ``times`` times in a row in one call: the interpreter loops, so the GIL is
        released once for them all (a thread replaying step by step takes it back after each, and
        with a Python-busy thread beside it waits up to the interpreter's switch interval, 5 ms,
        every time)."""
        self._guard.check()
        with torch.jit.optimized_execution(False), torch.no_grad():  # thread-local (module docstring)
            self._loop(int(times), self._inputs)

    def check(self) -> None:
        self._guard.check()


class JitBackend:
    """Captures a no-argument fn over named buffers as a `JitGraph` (module docstring)."""

    name = "jit"

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = int(warmup)

    def capture(self, fn: CaptureFn, buffers: Any = None) -> JitGraph:
        if not callable(fn):
            raise CaptureError(f"capture needs a no-argument callable, got {type(fn).__name__}")
        tensors = named_tensors(buffers)
        if not tensors:
            raise CaptureError("the jit backend needs the step's named buffers (its graph's inputs)")
        inputs = list(tensors.values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace: see the module docstring
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks: static here
            traced, extra = _trace(fn, inputs)
            if extra or traced is None:  # packed weights, views taken before capture: inputs (docstring)
                inputs = inputs + extra
                traced, extra = _trace(fn, inputs)
                if extra or traced is None:
                    raise CaptureError("the jit trace kept finding operands that cannot be constants")
            loop = torch.jit.script(_Loop(traced))
        graph = JitGraph(loop, inputs, BufferGuard(buffers))
        for _ in range(self.warmup):
            graph.replay()
        return graph


def _trace(fn: CaptureFn, inputs: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """(the traced step, or None where a packed weight stopped it; the extra operands found)."""
    try:
        with torch.no_grad(), _Operands(inputs) as seen:
            traced = torch.jit.trace(_Step(fn, inputs[0]), (inputs,), check_trace=False)
        return traced, seen.extra()
    except RuntimeError as exc:
        if _OPAQUE_CONSTANT in str(exc):
            return None, extra_operands(fn, inputs)
        if "requires grad" not in str(exc):
            raise
        raise CaptureError("the jit backend holds the step's weights as constants, which must not "
                           "require grad: freeze them (module.requires_grad_(False))") from None


class _Operands(TorchFunctionMode):
    """Collects, in first-use order, the tensors passed to torch calls that cannot be graph constants
    (module docstring): oneDNN-packed ones, and ones sharing a buffer's storage that the step did not
    make. The step's own tensors are the buffers and the outputs of the torch calls it makes."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.made = {id(t): t for t in inputs}  # kept alive while collecting: ids are not reused
        self.storages = {t.untyped_storage().data_ptr() for t in inputs if not t.is_mkldnn}
        self.found: dict[int, torch.Tensor] = {}

    def extra(self) -> list[torch.Tensor]:
        return list(self.found.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.made and id(t) not in self.found \
                    and (t.is_mkldnn or t.untyped_storage().data_ptr() in self.storages):
                self.found[id(t)] = t
        result = func(*args, **kwargs)
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.made.setdefault(id(t), t)
        return result


def extra_operands(fn: CaptureFn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``fn`` passes to torch calls that cannot be constants of a graph over ``inputs``
    (module docstring), found by running it once eagerly."""
    with torch.no_grad(), _Operands(inputs) as seen:
        fn()
    return seen.extra()


class _Step(torch.nn.Module):
    """What is traced: ``fn`` over the buffers, given as one list (the graph's input)."""

    def __init__(self, fn: CaptureFn, probe: torch.Tensor) -> None:
        super().__init__()
        self.fn, self.probe = fn, probe

    def forward(self, buffers: list[Tensor]) -> Tensor:
        self.fn()  # reads and writes the buffers themselves: the tracer maps them to the inputs
        return self.probe  # a trace must return something; the step's results are in its buffers


class _Loop(torch.nn.Module):
    """The traced step ``times`` times in one interpreter call (`JitGraph.replay`)."""

    def __init__(self, step: Any) -> None:
        super().__init__()
        self.step = step

    def forward(self, times: int, buffers: list[Tensor]) -> None:
        for _ in range(times):
            self.step(buffers)
