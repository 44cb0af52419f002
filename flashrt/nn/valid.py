"""Where the real data ends on a padded time axis: `ValidLength` (padded graphs) and `EXACT` (no padding).

Graphs run at a bucket length; the real input is ``length`` frames and the rest is padding. Every layer
whose output near the end depends on what lies past the end must see what the unpadded run would have
seen: a zero-padded conv needs zeros there (`ValidLength.zero`), a replicate-padded filter the last
valid value (`ValidLength.hold`). Convs and resamplers take ``valid`` and fix up, in place, just the
padding steps they can reach (their halo) before running; `EXACT` (the default) does nothing, for
inputs that are not padded. Outputs past ``length`` are garbage and are trimmed by the caller.
"""

from __future__ import annotations

import torch

__all__ = ["EXACT", "ValidLength"]


class _Exact:
    """No padding: the tensors are exactly as long as the data. `zero`/`hold` return x unchanged."""

    def zero(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        return x

    def hold(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        return x

    def add_end(self, y: torch.Tensor, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        """y[..., -R:] += x[..., -1:] * gains (R = len(gains)), in place."""
        y[..., y.shape[-1] - gains.numel():].add_(x[..., -1:] * gains)
        return y

    def __repr__(self) -> str:
        return "EXACT"


EXACT = _Exact()


class ValidLength:
    """Where the real data ends on a padded time axis; built inside a captured fn for one forward.

    ``length`` is a static (1,) int64 buffer holding the valid number of frames (1..frames), ``frames``
    the padded number of frames of the graph. A tensor whose last axis is ``frames * r`` long (any rate
    r, e.g. after upsampling) has valid steps ``[0, end)``, ``end = length * r``; the rest is padding.

    * ``zero(x)`` / ``hold(x)``: a new tensor with all the padding set to 0 / to ``x[..., end - 1]``
      (replicate padding). Simple and safe anywhere.
    * ``zero(x, halo)`` / ``hold(x, halo)``: the same, in place, for just the steps ``[end, end + halo)``
      a layer's valid outputs can reach: constant cost instead of a pass over x. The rest of the
      padding holds garbage. Writing into the padding in place is safe as long as every layer that
      reads padding fixes it itself right before (tensors shared by several branches are then fixed
      by each in turn); the convs and resamplers of this module do. Steps past the axis are clamped
      onto its last step and write the value already there when it is a valid step.

    All ops are graph-safe (no host sync); index tensors are made once per (steps, halo) per forward.
    """

    def __init__(self, length: torch.Tensor, frames: int) -> None:
        self.length = length.reshape(1)
        self.frames = int(frames)
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _index(self, steps: int, halo: int) -> tuple[torch.Tensor, ...]:
        """(end (1,), last valid step (1,), fill steps (halo,) clamped, fill step is padding (halo,))."""
        found = self._cache.get((steps, halo))
        if found is None:
            rate, rem = divmod(steps, self.frames)
            if rem:
                raise ValueError(f"time axis {steps} is not a multiple of the {self.frames} padded frames")
            end = self.length * rate
            positions = torch.arange(max(halo, steps if halo == 0 else 0), device=end.device)
            fill = (end + positions).clamp_max(steps - 1) if halo else positions
            found = self._cache[(steps, halo)] = (end, (end - 1).clamp_min(0), fill, fill >= end)
        return found

    def zero(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        """x (..., T) with the padding (all, or its first `halo` steps in place) set to 0."""
        if halo is None:
            _, _, _, pad = self._index(x.shape[-1], 0)
            return x.masked_fill(pad, 0.0)
        if halo <= 0:
            return x
        _, _, fill, pad = self._index(x.shape[-1], halo)
        value = x.index_select(-1, fill).masked_fill_(pad, 0.0)            # keeps valid steps as they are
        return x.index_copy_(-1, fill, value)

    def add_end(self, y: torch.Tensor, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        """y[..., e_y - R + i] += x[..., e_x - 1] * gains[i] in place, e the real end on each tensor's axis:
        the replicate padding's share at the end of the data, added exactly as `EXACT.add_end` adds it
        at the end of an unpadded tensor (same products, same single add), so a padded window and an
        unpadded run of the same data round alike."""
        _, last, _, _ = self._index(x.shape[-1], 0)
        key = ("tail", y.shape[-1], gains.numel())
        pos = self._cache.get(key)
        if pos is None:
            end, _, _, _ = self._index(y.shape[-1], 0)
            steps = torch.arange(gains.numel(), device=end.device)
            pos = self._cache[key] = (end - gains.numel() + steps).clamp_min(0)
        return y.index_add_(-1, pos, x.index_select(-1, last) * gains)

    def hold(self, x: torch.Tensor, halo: int | None = None) -> torch.Tensor:
        """x (..., T) with the padding (all, or its first `halo` steps in place) set to x[..., end - 1]."""
        if halo is not None and halo <= 0:
            return x
        _, last, fill, pad = self._index(x.shape[-1], 0 if halo is None else halo)
        edge = x.index_select(-1, last)                                      # (..., 1)
        if halo is None:
            return torch.where(pad, edge, x)
        value = torch.where(pad, edge, x.index_select(-1, fill))
        return x.index_copy_(-1, fill, value)
