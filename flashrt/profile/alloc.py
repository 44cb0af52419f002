"""Tensor allocations per call of a hot path, the captured step left out, counted on any device.

A call of `Policy.infer` is host work around one replay: check the observation, write the static
inputs, replay, read the outputs. On a GPU the replay is one graph launch; everything else is Python
and small torch ops on the host, and each tensor it allocates is an allocator round trip (a caching
allocator call on the device, malloc on the host) that a steady-state call should not need. The rule
this module measures: **the allocations per call outside the replay are a small constant**, the same
for a tiny and a release-size model.

    from flashrt.profile.alloc import count_infer_allocations
    count = count_infer_allocations(policy, obs, calls=5, seed=0)
    count.per_call        # [n, n, n, n, n] after the warm-up calls
    count.by_op           # which ops allocated, summed over the counted calls

What counts as one allocation (`AllocationCounter`, a TorchDispatchMode, op by op as the dispatcher
sees them):

* every output of an op that shares no storage with any of the op's inputs: factories (``empty``,
  ``zeros``, ``randn``), out-of-place math (``add``, ``_to_copy``, ``clone``, reductions); an
  in-place op or an ``out=`` write into an existing tensor returns that tensor and is none, and so
  are views (``view``, ``slice``, ``select``, ``permute``, a ``.to()`` that returns its input);
* ``lift_fresh`` (a tensor entering torch from host data: ``torch.tensor``, ``torch.as_tensor`` of a
  list, ``torch.from_numpy``) counts one as well, under its own name: the dispatcher cannot tell a
  copy (``torch.tensor``) from a wrap of numpy memory (``from_numpy``), so it is counted, not guessed.

What is NOT seen: memory torch allocates below the dispatcher (a numpy array made by ``.numpy()`` /
``astype``, Python objects, pinned-memory host caches). The count is of torch tensors, the figure that
grows with a careless hot path; host time per call is measured separately (docs/benchmarks/pi0.md).

The replay is left out honestly: `count_infer_allocations` wraps the frontend's ``replay`` verb (the
one call the runner makes for the captured step) in ``counter.pause()`` for the counted calls, so
everything the runner and the family do around it (check, write, read, timing) is counted and nothing
the step does is. On the eager backend the paused region runs the model eagerly; on a graph backend it
is the launch; either way it is the same region.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrt.profile.kernels import AllocationCounter, fresh_outputs

__all__ = ["AllocationCount", "CallAllocationCounter", "count_allocations", "count_infer_allocations",
           "paused"]

LIFT = "lift_fresh"  # host data entering torch (module docstring)


class CallAllocationCounter(AllocationCounter):
    """`AllocationCounter` that also counts ``lift_fresh`` (host data made a tensor) as one allocation
    (module docstring) and tallies the device of every allocation (``by_device``: "cpu", "cuda:0",
    ...); ``pause()`` leaves a region out."""

    def __init__(self) -> None:
        super().__init__()
        self.by_device: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        fresh = fresh_outputs(func, args, kwargs, out)
        if not fresh and func.overloadpacket.__name__ == LIFT and isinstance(out, torch.Tensor):
            fresh = [out]
        for t in fresh:
            self.allocations += 1
            self.by_op[str(func)] += 1
            self.by_device[str(t.device)] += 1
        return out


@dataclass
class AllocationCount:
    """Allocations of each counted call (``per_call``) and by op name over all of them (``by_op``)."""

    per_call: list[int] = field(default_factory=list)
    by_op: Counter = field(default_factory=Counter)
    by_device: Counter = field(default_factory=Counter)

    @property
    def constant(self) -> int | None:
        """The count when every counted call allocated the same; None when they differ."""
        return self.per_call[0] if self.per_call and len(set(self.per_call)) == 1 else None

    def to_dict(self, top: int = 12) -> dict[str, Any]:
        return {"per_call": list(self.per_call), "top": dict(self.by_op.most_common(top)),
                "by_device": dict(self.by_device)}


def count_allocations(fn: Callable[[CallAllocationCounter], Any]) -> CallAllocationCounter:
    """Run ``fn(counter)`` once under a fresh `CallAllocationCounter` (fn may use ``counter.pause()``);
    the counter, with its ``allocations``, ``by_op`` and ``by_device``."""
    counter = CallAllocationCounter()
    with counter:
        fn(counter)
    return counter


@contextmanager
def paused(obj: Any, verb: str, counter: CallAllocationCounter) -> Iterator[None]:
    """While inside: ``obj.<verb>(...)`` runs under ``counter.pause()`` (an instance attribute
    shadows the method; removed on exit, also on an exception)."""
    original = getattr(obj, verb)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with counter.pause():
            return original(*args, **kwargs)

    setattr(obj, verb, wrapped)
    try:
        yield
    finally:
        delattr(obj, verb)


def count_infer_allocations(policy: Any, obs: Any, calls: int = 5, warmup: int = 2,
                            **infer_kwargs: Any) -> AllocationCount:
    """Allocations per ``policy.infer(obs, **infer_kwargs)`` outside the replay (module docstring):
    ``warmup`` uncounted calls first (first-use caches are built there), then ``calls`` counted ones."""
    for _ in range(warmup):
        policy.infer(obs, **infer_kwargs)
    result = AllocationCount()
    for _ in range(calls):
        def one(counter: CallAllocationCounter) -> None:
            with paused(policy.frontend, "replay", counter):
                policy.infer(obs, **infer_kwargs)

        counter = count_allocations(one)
        result.per_call.append(counter.allocations)
        result.by_op.update(counter.by_op)
        result.by_device.update(counter.by_device)
    return result
