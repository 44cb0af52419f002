"""NVTX ranges for Nsight timelines; a no-op where no NVTX provider is present.

Providers, first found wins: the `nvtx` package (pip `nvtx`), then `torch.cuda.nvtx` when CUDA is
available. The provider is looked up once, on the first range; nothing is read from the environment.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

_PROVIDER: list[Callable[[str], Any] | None] = []


def _nvtx_package(name: str) -> Any:
    import nvtx

    return nvtx.annotate(name)


@contextmanager
def _torch_range(name: str) -> Iterator[None]:
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def _find_provider() -> Callable[[str], Any] | None:
    if importlib.util.find_spec("nvtx") is not None:
        return _nvtx_package
    try:
        import torch
    except ImportError:
        return None
    return _torch_range if torch.cuda.is_available() else None


def nvtx_provider() -> str:
    """Name of the NVTX provider in use: 'nvtx', 'torch' or 'none'."""
    provider = _provider()
    return {_nvtx_package: "nvtx", _torch_range: "torch"}.get(provider, "none")


def _provider() -> Callable[[str], Any] | None:
    if not _PROVIDER:
        _PROVIDER.append(_find_provider())
    return _PROVIDER[0]


def nvtx_range(name: str) -> Any:
    """Context manager marking `name` on the NVTX timeline (a no-op without a provider)."""
    provider = _provider()
    return nullcontext() if provider is None else provider(name)
