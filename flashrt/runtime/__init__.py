"""Runtime core: declared buffers, graph backends (cuda / trace / eager), shape buckets, devices.

The `trace` and `cuda` backends are imported on first use through the registry in `graphs`.
"""

from flashrt.runtime.buckets import FallbackCounter, GraphSet, length_mask, pad_to
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.device import available_backends, describe_device, device_arch, resolve_device
from flashrt.runtime.graphs import Graph, GraphBackend, backend_names, get_backend, register_backend

__all__ = [
    "Buffers", "BufferSpec", "FallbackCounter", "Graph", "GraphBackend", "GraphSet", "available_backends",
    "backend_names", "describe_device", "device_arch", "get_backend", "length_mask", "pad_to",
    "register_backend", "resolve_device",
]
