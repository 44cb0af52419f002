"""A speech server (`flashrt.serve.app`) on a free local port, in a thread, for the serve tests."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """uvicorn serving `build_app(server)` on 127.0.0.1; ``threads`` sets the size of its event loop's
    default executor (None: asyncio's own default)."""

    def __init__(self, server, threads: int | None = None) -> None:
        import uvicorn

        from flashrt.serve.app import build_app

        self.port = free_port()
        config = uvicorn.Config(build_app(server), host="127.0.0.1", port=self.port, log_level="warning")
        self.uv = uvicorn.Server(config)

        async def serve():
            if threads is not None:
                asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=threads))
            await self.uv.serve()

        self.thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
