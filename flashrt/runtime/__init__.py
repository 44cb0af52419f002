"""Runtime core: declared buffers, graph backends (cuda / trace / eager), shape buckets, devices."""

from flashrt.runtime.buffers import Buffers, BufferSpec

__all__ = ["Buffers", "BufferSpec"]
