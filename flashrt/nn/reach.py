"""Receptive fields derived from the built modules: how far one output depends on inputs, in frames.

Every block of the audio stack answers ``module.reach(rate) -> Reach``: the inputs an output depends on
to its left and right, in frames, for an input running at ``rate`` samples per frame, computed from its
own geometry (kernel, dilation, padding, stride, resampling filter). Blocks made of blocks compose
their children's reaches (in sequence: add; parallel branches summed: `Reach.widest`); a family's
top module does the same over its layers, so the streaming context is never restated by hand.
`receptive_field(module)` is the top module's reach in whole frames.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

__all__ = ["Reach", "Reaches", "get_padding", "receptive_field", "chain"]


def get_padding(kernel: int, dilation: int = 1) -> int:
    """'Same' padding of a stride-1 conv: (kernel*dilation - dilation) // 2."""
    return (kernel * dilation - dilation) // 2


@dataclass(frozen=True)
class Reach:
    """How far one output depends on inputs to its left and right, in frames (exact fractions)."""

    left: Fraction = Fraction(0)
    right: Fraction = Fraction(0)

    def __add__(self, other: Reach) -> Reach:
        return Reach(self.left + other.left, self.right + other.right)

    def frames(self) -> tuple[int, int]:
        """(left, right) rounded up to whole frames."""
        return math.ceil(self.left), math.ceil(self.right)

    @staticmethod
    def conv(kernel: int, dilation: int = 1, rate: int = 1, padding: int | None = None) -> Reach:
        """A stride-1 conv at `rate` samples per frame, with the given (default "same") left padding."""
        span = dilation * (kernel - 1)
        pad = get_padding(kernel, dilation) if padding is None else padding
        return Reach(Fraction(pad, rate), Fraction(span - pad, rate))

    @staticmethod
    def conv_transpose(kernel: int, stride: int, padding: int, rate: int = 1) -> Reach:
        """A transposed conv whose input runs at `rate` samples per frame (output at rate*stride)."""
        out_rate = rate * stride
        return Reach(Fraction(kernel - 1 - padding, out_rate), Fraction(padding, out_rate))

    @staticmethod
    def widest(reaches: Sequence[Reach]) -> Reach:
        """Parallel branches (summed outputs): the largest reach on each side."""
        return Reach(max(r.left for r in reaches), max(r.right for r in reaches))


@runtime_checkable
class Reaches(Protocol):
    """A module that knows its receptive field at an input rate (samples per frame)."""

    def reach(self, rate: int = 1) -> Reach: ...


def chain(modules: Iterable[Reaches], rate: int = 1) -> Reach:
    """Modules applied one after the other at one rate (none of them resamples)."""
    return sum((m.reach(rate) for m in modules), Reach())


def receptive_field(module: Reaches, rate: int = 1) -> tuple[int, int]:
    """(left, right) whole frames one output of `module` depends on (its `reach`, rounded up)."""
    return module.reach(rate).frames()
