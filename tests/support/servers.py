"""The speech server on a free local port, in a thread, for the serve tests (`flashrt.serve.thread`)."""

from __future__ import annotations

from flashrt.serve.thread import ServerThread, free_port

RunningServer = ServerThread

__all__ = ["RunningServer", "free_port"]
