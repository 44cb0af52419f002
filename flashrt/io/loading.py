"""The one loading path: build on meta, map strictly, assign, derive, check.

``load_module(build, checkpoint, weight_map, device="cpu", dtype=None)``:

1. ``build()`` runs under ``torch.device("meta")``: no memory is allocated, no init kernels run.
2. Expected slots are ``module.state_dict()`` (parameters and persistent buffers) with their shapes and
   dtypes; a global ``dtype`` replaces the dtype of 16/32/64-bit float slots only (integer, bool and
   8-bit float slots keep theirs).
3. ``weight_map.apply(checkpoint, expected)`` maps strictly: missing, unexpected and mis-shaped keys come
   back together in one CheckpointError. Each tensor is cast (``Rule.dtype`` first, else the slot dtype).
4. Each tensor moves to ``device`` as soon as it is built (peak host memory: one tensor, plus whatever
   the OS keeps of the memory map), then all are assigned with ``load_state_dict(strict=True,
   assign=True)``.
5. ``reset_derived()`` is called on every submodule defining it (children first), under
   ``torch.device(device)``, so factory calls without a device land on the target device. It must
   (re)compute non-persistent buffers (RoPE tables, filters, windows) from config and loaded weights.
6. No meta tensor may remain (a forgotten derived buffer is a CheckpointError naming it), unless
   ``device`` is meta itself (a shape-only model, e.g. to count the kernels of a release-size step).

The module comes back in eval mode with ``requires_grad`` off. Back-compat for renamed checkpoint keys
is expressed in the weight map with ``Alt(...)`` sources; their use is logged at INFO in one place
(``weightmap._pick_option``). There is no other patching.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.io.weightmap import WeightMap

log = logging.getLogger(__name__)

_CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

__all__ = ["load_module", "build_on_meta", "expected_slots", "meta_tensors", "meta_twin", "reset_derived"]


def load_module(
    build: Callable[[], nn.Module],
    checkpoint: Mapping[str, torch.Tensor],
    weight_map: WeightMap,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build ``build()`` on meta, fill it strictly from ``checkpoint`` through ``weight_map``."""
    device = torch.device(device)
    module = build_on_meta(build)
    tensors = weight_map.apply(checkpoint, expected_slots(module, dtype), device=device)
    module.load_state_dict(tensors, strict=True, assign=True)
    reset_derived(module, device)
    leftover = meta_tensors(module) if device.type != "meta" else []
    if leftover:
        raise CheckpointError(f"{type(module).__name__}: {len(leftover)} tensor(s) still on the meta device "
                              f"after loading: {', '.join(leftover[:20])}. Non-persistent buffers must be "
                              "computed in a reset_derived() method of their module.")
    log.debug("loaded %s from %s: %d tensors on %s", type(module).__name__,
              getattr(checkpoint, "name", "<mapping>"), len(tensors), device)
    return module.eval().requires_grad_(False)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Inside `build_on_meta`: ``torch.nn.init`` functions return their tensor untouched. On meta they
    compute nothing anyway (every value comes from the checkpoint, strictly), but torch runs them
    through its Python references, whose first use imports torch._dynamo (over a second of a cold
    start). A torch function mode is per thread: another thread's modules are initialised as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_FUNCS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_INIT_FUNCS = frozenset(getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_")
                        and not name.startswith("_") and callable(getattr(nn.init, name)))


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under the meta device, ``torch.nn.init`` skipped (`_SkipInit`); refuses a builder
    that returns something other than a Module."""
    try:
        with torch.device("meta"), _SkipInit():
            module = build()
    except Exception as exc:
        exc.add_note("(raised by build() under the meta device: a constructor must not read tensor values "
                     "or call .item()/.tolist(); derive such values in reset_derived())")
        raise
    if not isinstance(module, nn.Module):
        raise TypeError(f"build() must return an nn.Module, got {type(module).__name__}")
    return module


def expected_slots(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``state_dict()`` as meta tensors; with ``dtype``, 16/32/64-bit float slots take that dtype.

    8-bit float slots (quantized weights) keep their dtype, as do integer and bool buffers.
    """
    slots: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict().items():
        want = dtype if dtype is not None and t.dtype in _CASTABLE else t.dtype
        slots[key] = torch.empty(t.shape, dtype=want, device="meta")
    return slots


def reset_derived(module: nn.Module, device: torch.device | str) -> None:
    """Call ``reset_derived()`` on every submodule defining it, children before parents."""
    with torch.device(device):
        for sub in reversed(list(module.modules())):
            hook: Any = getattr(sub, "reset_derived", None)
            if callable(hook):
                hook()


def meta_tensors(module: nn.Module) -> list[str]:
    """Names of parameters and buffers (persistent or not) still on the meta device."""
    named = list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.is_meta]


def meta_twin(build: Callable[[], nn.Module], dtype: torch.dtype | None = None,
              slots: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A shape-only module on the meta device (no weight memory, no compute), e.g. to count the kernels
    of a release-size step (`flashrt.profile.kernels`): ``build()`` on meta, assigned ``slots`` (meta
    tensors; default `expected_slots` with ``dtype``), derived tables computed by ``reset_derived``
    on meta, or, for a module whose derivation reads values (a filter's edge extent), on the CPU and
    then moved to meta together with every tensor (or tuple of tensors) held as a plain attribute."""
    module = build_on_meta(build)
    module.load_state_dict(dict(slots) if slots is not None else expected_slots(module, dtype),
                           strict=True, assign=True)
    try:
        reset_derived(module, "meta")
    except (NotImplementedError, RuntimeError):
        reset_derived(module, "cpu")
        _move_to_meta(module)
    return module.eval().requires_grad_(False)


def _move_to_meta(module: nn.Module) -> None:
    module.to("meta")
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                setattr(sub, name, value.to("meta"))
            elif isinstance(value, tuple | list) and value and all(isinstance(t, torch.Tensor)
                                                                    for t in value):
                setattr(sub, name, type(value)(t.to("meta") for t in value))
