"""Device and architecture detection.

`resolve_device` turns a user's device string into a `torch.device` (or raises `DeviceError` saying
why it cannot run here), `device_arch` names the architecture for cache keys ("sm90",
"cpu-x86_64"), `describe_device` gathers what `flashrt info` prints, and `available_backends`
lists the graph backends that can run on a device, preferred first.

Nothing here changes global torch state; CUDA is only queried, never initialised for work.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Callable
from typing import Any

import torch

from flashrt.errors import DeviceError
from flashrt.runtime.graphs import backends_for

DeviceLike = str | torch.device

_CUDA_INDEX = re.compile(r"^cuda(?::(\d+))?$")


def _resolve_cpu(spec: str) -> torch.device:
    if spec != "cpu":
        raise DeviceError(f"device {spec!r}: the CPU takes no index; use 'cpu'")
    return torch.device("cpu")


def _resolve_cuda(spec: str) -> torch.device:
    match = _CUDA_INDEX.match(spec)
    if match is None:
        raise DeviceError(f"device {spec!r} is not of the form 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {spec!r} asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use 'cpu' or 'auto'"
        )
    index = int(match.group(1) or 0)  # "cuda" is cuda:0; asking the current device would init CUDA
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {spec!r}: only {count} CUDA device(s) visible (0..{count - 1})")
    return torch.device("cuda", index)


def _resolve_auto(spec: str) -> torch.device:
    return _resolve_cuda("cuda") if torch.cuda.is_available() else torch.device("cpu")


_RESOLVERS: dict[str, Callable[[str], torch.device]] = {
    "cpu": _resolve_cpu,
    "cuda": _resolve_cuda,
    "auto": _resolve_auto,
}


def resolve_device(spec: DeviceLike = "auto") -> torch.device:
    """Return the torch.device for "cpu", "cuda" (= "cuda:0"), "cuda:N", "auto" (CUDA if present).

    A torch.device is accepted too. Only queries CUDA (availability, device count), never initialises it.

    Raises DeviceError when CUDA is asked for and not available, or the form is unknown.
    """
    text = str(spec).strip().lower()
    kind = text.split(":", 1)[0]
    resolver = _RESOLVERS.get(kind)
    if resolver is None:
        raise DeviceError(f"unknown device {spec!r}; use one of 'cpu', 'cuda', 'cuda:N', 'auto'")
    return resolver(text)


def device_arch(device: DeviceLike) -> str:
    """Architecture tag used in cache keys: "sm90" for a CUDA device, "cpu-x86_64" for the CPU."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"sm{major}{minor}"
    return f"cpu-{platform.machine().lower() or 'unknown'}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _describe_cpu(dev: torch.device) -> dict[str, Any]:
    from flashrt.ops.platform import activation_qmax, cpu_int8_dot

    probe = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)
    return {
        "name": _cpu_name(),
        "capability": None,
        "memory_bytes": _cpu_memory_bytes(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "isa": probe(),  # the vector ISA torch's kernels run ("AVX2", "AVX512", ...)
        # what int8 gets here: VNNI / AMX int8 dot products take 8-bit activations (±127), AVX2's 7 bits
        "int8": {**cpu_int8_dot(), "activation_qmax": activation_qmax("cpu")},
    }


def _describe_cuda(dev: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(dev)
    return {
        "name": props.name,
        "capability": [props.major, props.minor],
        "memory_bytes": int(props.total_memory),
        "multiprocessors": props.multi_processor_count,
        "cudnn": torch.backends.cudnn.version(),
    }


_DESCRIBERS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "cpu": _describe_cpu,
    "cuda": _describe_cuda,
}


def describe_device(device: DeviceLike = "auto") -> dict[str, Any]:
    """What `flashrt info` prints: name, arch, capability, memory, torch/CUDA versions, backends."""
    dev = resolve_device(device)
    info: dict[str, Any] = {"device": str(dev), "type": dev.type, "arch": device_arch(dev)}
    info.update(_DESCRIBERS[dev.type](dev))
    info.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        backends=available_backends(dev),
    )
    return info


def available_backends(device: DeviceLike = "auto") -> list[str]:
    """Graph backends that can run on `device`, preferred first (the first is the default)."""
    return backends_for(resolve_device(device).type)
