"""The numerics a step runs under on a GPU, pinned per family and scoped to the step.

    numerics = Numerics(tf32=False, sdpa=("flash", "efficient", "math"))
    with numerics.scope(device):       # what a frontend's step does around the model call
        model(...)

* ``tf32``: whether float32 matmuls (cuBLAS) and cuDNN convolutions may run in TF32. Default False:
  precision "float32" means IEEE float32 (torch's own default lets cuDNN convs use TF32). It is a load
  option of a family (``load_policy(..., tf32=True)``), never an environment switch.
* ``sdpa``: the scaled-dot-product-attention backends allowed, in priority order
  (`torch.nn.attention.sdpa_kernel(..., set_priority=True)`), names of `SDPA_BACKENDS`; torch takes the
  first that supports the call's shapes and dtype, so the choice no longer depends on whatever the
  caller's process enabled. None leaves torch's choice.

Decision: set per step, restored after, never at load. Both are process-wide torch flags: setting them at
load would change every other model of the caller's process, and a later change by the caller would
change ours. The scope sets them on entry and restores the caller's values on exit (also on an
exception, `HOUSE_STYLE` #4). A CUDA graph keeps the kernels chosen while it was captured (inside the
scope), so its replays do not read the flags at all; eager replays enter the scope every call. While a
step runs, another thread of the process sees our flags (one caller per frontend is the rule anyway).

Only a CUDA device is affected: on the CPU (and meta, for kernel counting) the scope is empty, so the
CPU keeps torch's fused CPU attention and its float32 GEMMs, whose numerics the flags do not touch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashrt.errors import ConfigError

__all__ = ["Numerics", "SDPA_BACKENDS", "sdpa_backends"]

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def sdpa_backends(names: tuple[str, ...]) -> list:
    """`torch.nn.attention.SDPBackend` members for ``names`` (`SDPA_BACKENDS`), in order."""
    from torch.nn.attention import SDPBackend

    members = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return [members[n] for n in names]


@dataclass(frozen=True)
class _Flag:
    """One TF32 switch: torch >= 2.9's ``fp32_precision`` ("tf32" / "ieee") on `owner`, or the legacy
    boolean ``allow_tf32``. Once a caller has set the new API, reading the legacy flag raises, so the
    new one is used wherever it exists; the value read is restored as it was (string or bool)."""

    owner: object
    new: bool

    def get(self) -> object:
        return self.owner.fp32_precision if self.new else self.owner.allow_tf32

    def set(self, tf32: bool) -> None:
        if self.new:
            self.owner.fp32_precision = "tf32" if tf32 else "ieee"
        else:
            self.owner.allow_tf32 = tf32

    def restore(self, value: object) -> None:
        if self.new:
            self.owner.fp32_precision = value
        else:
            self.owner.allow_tf32 = value


def tf32_flags() -> tuple[_Flag, _Flag]:
    """The cuBLAS matmul and cuDNN conv TF32 switches of this torch (`_Flag`)."""
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision") and _has_attr(matmul, "fp32_precision"):
        return _Flag(matmul, True), _Flag(conv, True)
    return _Flag(matmul, False), _Flag(torch.backends.cudnn, False)


def _has_attr(owner: object, name: str) -> bool:
    try:
        getattr(owner, name)
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass(frozen=True)
class Numerics:
    """What a step pins on a GPU (module docstring)."""

    tf32: bool = False
    sdpa: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tf32, bool):
            raise ConfigError(f"tf32 must be True or False, got {self.tf32!r}")
        if self.sdpa is not None:
            unknown = [n for n in self.sdpa if n not in SDPA_BACKENDS]
            if unknown or not self.sdpa:
                raise ConfigError(f"sdpa backends {list(self.sdpa)}: choose from {SDPA_BACKENDS}")

    def describe(self) -> dict[str, object]:
        return {"tf32": self.tf32, "sdpa": list(self.sdpa) if self.sdpa else None}

    @contextlib.contextmanager
    def scope(self, device: torch.device | str) -> Iterator[None]:
        """These numerics inside the block on a CUDA ``device``; the caller's flags restored after."""
        if torch.device(device).type != "cuda":
            yield
            return
        with self._tf32(), self._sdpa():
            yield

    @contextlib.contextmanager
    def _tf32(self) -> Iterator[None]:
        flags = tf32_flags()
        saved = [flag.get() for flag in flags]
        for flag in flags:
            flag.set(self.tf32)
        try:
            yield
        finally:
            for flag, value in zip(flags, saved):
                flag.restore(value)

    def _sdpa(self) -> contextlib.AbstractContextManager:
        if self.sdpa is None:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        try:
            return sdpa_kernel(sdpa_backends(self.sdpa), set_priority=True)
        except TypeError:  # torch < 2.6: no priority, its own order (flash, efficient, cudnn, math) applies
            return sdpa_kernel(sdpa_backends(self.sdpa))
