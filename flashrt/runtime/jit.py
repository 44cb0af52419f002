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
* Python values and control flow are frozen at capture, as for every backend (`flashrt.runtime.graphs`):
  the tracer's warnings (mostly shape checks, static here) are not shown; a step that reads a tensor's
  value on the host would be frozen silently, so a graph body is checked under the `trace` backend,
  which refuses host syncs.
* ``replay(times)`` runs the step that many times in one call (a scripted loop around the traced
  step): the GIL is released once for the whole block. A thread replaying step by step takes the GIL
  back after every step, and while another thread runs Python it waits up to the switch interval
  (5 ms) each time; the slot decoder replays its blocks this way (`flashrt.runtime.slots`).
* Capture runs ``fn`` for real (the trace), then replays it ``warmup`` more times so the interpreter's
  profiling runs are done before the first timed replay: fn's effects on its buffers happen
  ``1 + warmup`` times at capture, as with the `trace` and `cuda` backends.

Replays run the same aten ops on the same tensors as eager (TorchScript's CPU fusers are off by
default and the other passes do not change values), so results equal eager bit for bit; tests check
it per user (`flashrt.runtime.slots`). CPU only: a CUDA step has CUDA graphs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from flashrt.errors import CaptureError
from flashrt.runtime.graphs import BufferGuard, CaptureFn, named_tensors

__all__ = ["JitBackend", "JitGraph"]


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
        with torch.no_grad():
            self._loop(int(times), self._inputs)

    def check(self) -> None:
        self._guard.check()


class JitBackend:
    """Captures a no-argument fn over named buffers as a `JitGraph` (module docstring)."""

    name = "jit"

    def __init__(self, warmup: int = 2) -> None:
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
            try:
                with torch.no_grad():
                    traced = torch.jit.trace(_Step(fn, inputs[0]), (inputs,), check_trace=False)
            except RuntimeError as exc:
                if "requires grad" not in str(exc):
                    raise
                raise CaptureError("the jit backend holds the step's weights as constants, which must not "
                                   "require grad: freeze them (module.requires_grad_(False))") from None
            loop = torch.jit.script(_Loop(traced))
        graph = JitGraph(loop, inputs, BufferGuard(buffers))
        for _ in range(self.warmup):
            graph.replay()
        return graph


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
