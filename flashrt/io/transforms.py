"""Ready-made weight-map transforms. Each takes the rule's source tensors positionally, returns one tensor.

Factories (``transpose(0, 1)``, ``concat(0)`` ...) return small frozen dataclasses, so a transform has a
readable repr in error messages and compares equal to an identical one. All of them work on meta
tensors, which is how `WeightMap` checks shapes before reading any data.

Weight norm. ``fold_weight_norm(g, v, dim=0)`` computes ``w = g * v / ||v||`` where the norm runs over
every dimension except ``dim`` (``dim=None``: over the whole tensor), exactly as
``torch.nn.utils.weight_norm`` and ``torch.nn.utils.parametrizations.weight_norm`` define it. Both torch
functions default to ``dim=0`` for every module type, ConvTranspose1d included (whose weight is laid out
``(in, out/groups, k)``, so its g has shape ``(in, 1, 1)``); HiFi-GAN, BigVGAN and Vocos checkpoints use
that default. As in torch, ``dim=-1`` means "whole tensor", like ``None``. The fold is computed in
float32 and cast back to ``v``'s dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["fold_weight_norm", "weight_norm", "transpose", "permute", "concat", "split", "reshape",
           "to_dtype", "chain"]


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor, dim: int | None = 0) -> torch.Tensor:
    """``g * v / ||v||``, norm over all dims but ``dim`` (``None`` or ``-1``: over the whole tensor).

    ``g`` may have the keep-dim shape (``(out, 1, 1)`` for dim 0) or any shape with the same element
    count. Runs ``torch._weight_norm``, the op torch's weight norm and ``remove_weight_norm`` run, so the
    folded weight is bit-identical to theirs in float32; ``g`` is validated first because that op does
    not check its shape on CPU (a wrong ``g`` corrupts memory instead of raising).
    """
    keep = _weight_norm_g_shape(v.shape, dim)
    if g.numel() != keep.numel():
        raise ValueError(f"weight norm: g of shape {tuple(g.shape)} does not fit v of shape {tuple(v.shape)} "
                         f"with dim={dim} (expected {tuple(keep)})")
    dim = -1 if dim is None or dim == -1 else dim % v.dim()
    return torch._weight_norm(v.float(), g.float().reshape(keep), dim).to(v.dtype)


def _weight_norm_g_shape(shape: torch.Size, dim: int | None) -> torch.Size:
    if dim is None or dim == -1:
        return torch.Size([1] * len(shape))
    dim = dim % len(shape)
    return torch.Size(n if d == dim else 1 for d, n in enumerate(shape))


@dataclass(frozen=True)
class weight_norm:  # noqa: N801 - reads as a function in weight-map tables
    """Transform for ``Rule(source=(g, v), ...)``: `fold_weight_norm` with a fixed ``dim``."""

    dim: int | None = 0

    def __call__(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fold_weight_norm(g, v, self.dim)


@dataclass(frozen=True)
class transpose:  # noqa: N801
    """Swap two dimensions (default: a 2-D matrix transpose)."""

    dim0: int = 0
    dim1: int = 1

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(self.dim0, self.dim1)


@dataclass(frozen=True, init=False)
class permute:  # noqa: N801
    """Reorder all dimensions: ``permute(2, 0, 1)``."""

    dims: tuple[int, ...]

    def __init__(self, *dims: int) -> None:
        object.__setattr__(self, "dims", tuple(dims))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.permute(*self.dims)


@dataclass(frozen=True)
class concat:  # noqa: N801
    """Concatenate all source tensors along ``dim`` (e.g. separate q, k, v → fused qkv)."""

    dim: int = 0

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.cat(tensors, dim=self.dim)


@dataclass(frozen=True)
class split:  # noqa: N801
    """Chunk ``index`` of ``n`` equal chunks along ``dim`` (e.g. fused qkv → q); sizes must divide."""

    index: int
    n: int
    dim: int = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        size = t.shape[self.dim]
        if size % self.n:
            raise ValueError(f"split: dim {self.dim} of size {size} is not divisible into {self.n} chunks")
        return t.narrow(self.dim, self.index * (size // self.n), size // self.n)


@dataclass(frozen=True, init=False)
class reshape:  # noqa: N801
    """``t.reshape(*shape)``."""

    shape: tuple[int, ...]

    def __init__(self, *shape: int) -> None:
        object.__setattr__(self, "shape", tuple(shape))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*self.shape)


@dataclass(frozen=True)
class to_dtype:  # noqa: N801
    """Cast to ``dtype`` (usually `Rule.dtype` says this more plainly)."""

    dtype: torch.dtype

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)


@dataclass(frozen=True, init=False)
class chain:  # noqa: N801
    """Compose: the first transform gets all sources, each next one the previous result."""

    steps: tuple

    def __init__(self, *steps) -> None:
        object.__setattr__(self, "steps", tuple(steps))

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.steps[0](*tensors)
        for step in self.steps[1:]:
            out = step(out)
        return out
