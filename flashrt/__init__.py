"""flashrt: set up once, replay forever — small-batch, latency-critical inference.

Imports stay light: the frontends are loaded on first use (PEP 562 `__getattr__`).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_policy": "flashrt.runner.policy",
    "Policy": "flashrt.runner.policy",
    "AsyncPolicy": "flashrt.runner.async_policy",
    "Guidance": "flashrt.runtime.rtc",
    "Runtime": "flashrt.runtime.owner",
    "load_vocoder": "flashrt.runner.vocoder",
    "load_tts": "flashrt.runner.tts",
    "InputError": "flashrt.errors",
    "CheckpointError": "flashrt.errors",
    "CaptureError": "flashrt.errors",
    "CalibrationError": "flashrt.errors",
    "DeviceError": "flashrt.errors",
    "ConfigError": "flashrt.errors",
    "NumericalError": "flashrt.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'flashrt' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
