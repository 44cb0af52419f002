"""A speech server (`flashrt.serve.app`) served by uvicorn on a thread of this process: for benchmarks
(`flashrt bench serve`), tests and notebooks. Binds 127.0.0.1 on a free port unless told otherwise."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["ServerThread", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``build_app(server)``; ``threads`` sets its event loop's default executor size
    (None: asyncio's own). `stop()` ends it; ``url`` is where it listens."""

    def __init__(self, server: Any, host: str = "127.0.0.1", port: int | None = None,
                 threads: int | None = None, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        from flashrt.serve.app import build_app

        self.port = port or free_port(host)
        config = uvicorn.Config(build_app(server), host=host, port=self.port, log_level="warning")
        self.uv = uvicorn.Server(config)

        async def serve() -> None:
            if threads is not None:
                asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=threads))
            await self.uv.serve()

        self.thread = threading.Thread(target=lambda: asyncio.run(serve()), name="flashrt-speech-server",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the speech server did not start on {host}:{self.port}")
            time.sleep(0.02)
        self.url = f"http://{host}:{self.port}"

    def stop(self, grace_s: float | None = None) -> None:
        """Stop serving. ``grace_s``: how long requests in flight may still run before they are cut
        (their clients see the response end early); None waits for them (uvicorn's default)."""
        if grace_s is not None:
            self.uv.config.timeout_graceful_shutdown = grace_s
        self.uv.should_exit = True
        self.thread.join(timeout=10 + (grace_s or 0.0))

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
