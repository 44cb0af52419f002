"""An openpi-compatible websocket policy server over one flashrt `Policy`.

Speaks the protocol of openpi's ``WebsocketPolicyServer`` so the unmodified ``openpi-client``
(``WebsocketClientPolicy``, ``ActionChunkBroker``) drives a flashrt policy:

    connect            the server sends one binary message: the metadata map (msgpack)
    binary message     an observation map (msgpack with numpy arrays, `flashrt.serve.wire`)
    reply (binary)     {"actions": (chunk, action_dim) float32, "policy_timing": {..},
                        "server_timing": {"infer_ms": .., "prev_total_ms": ..}}
    reply (text)       an error: the client raises it (openpi's convention for errors)
    GET /healthz       200 "OK" (a plain HTTP probe on the same port)

Observations are the ones `Policy.infer` takes (openpi style ``images`` / ``state`` / ``prompt`` or
lerobot keys). Two optional keys are a flashrt extension: ``seed`` (int) and ``noise`` (the family's
noise array) fix the randomness exactly as the in-process call does.

Failure behaviour: a malformed message (not msgpack, a forbidden dtype, a bad observation) gets a text
reply naming the problem and the connection stays usable; arrays in a dtype the policy cannot take are
converted where no value changes (float16 -> float32, small integers -> float32, 0..255 integer images
-> uint8, `flashrt.serve.wire.coerce`), else refused the same way. A message over ``max_message_bytes``
is refused by the websocket layer before any decoding (it closes that connection with code 1009); the
default limit follows what the policy takes (`message_limit`: its cameras at up to 1920x1080 float32,
plus 1 MiB), not a fixed 64 MiB. At most ``max_connections`` are open (more are closed at once with
1013, try again later), and the messages held at once (received, decoding or waiting for the worker)
stay within ``max_bytes_held``: a message beyond it gets a text reply and its connection stays. An
unexpected error is answered and the connection closed with 1011; a client that disconnects while its
request runs leaves the server healthy (the reply is dropped). Messages are decoded on their own
connection's thread, so a large one never stalls other clients; inference runs one request at a time,
in arrival order, on one worker thread (the only caller of the policy). Binds 127.0.0.1 unless told
otherwise. The metadata sent on connect names the checkpoint by its folder's name, never a server path.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from http import HTTPStatus
from typing import Any

from flashrt.errors import FlashRTError
from flashrt.serve.wire import WireError, coerce, packb, unpackb

__all__ = ["PolicyServer", "policy_metadata", "message_limit", "DEFAULT_MAX_MESSAGE_BYTES"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
MAX_IMAGE_BYTES = 1920 * 1080 * 3 * 4  # one camera frame at 1080p in float32
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013


def policy_metadata(policy: Any) -> dict[str, Any]:
    """What a client learns on connect: sizes, cameras and what was loaded (plain msgpack types; paths
    of this machine reduced to their last part)."""
    meta = {"server": "flashrt", "chunk_size": policy.chunk_size, "action_dim": policy.action_dim,
            "n_action_steps": policy.n_action_steps}
    try:
        meta["policy"] = _no_paths(json.loads(json.dumps(policy.frontend.describe(), default=str)))
    except (TypeError, ValueError, AttributeError):
        meta["policy"] = {}
    return meta


def _no_paths(value: Any) -> Any:
    """A describe() nest with every string that names a path of this machine cut to its last part."""
    if isinstance(value, dict):
        return {k: _no_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_paths(v) for v in value]
    if isinstance(value, str) and (os.sep in value or value.startswith("~")) and (
            os.path.isabs(value) or value.startswith("~") or os.path.exists(value)):
        return os.path.basename(value.rstrip(os.sep)) or "."
    return value


def message_limit(policy: Any) -> int:
    """The largest message an observation of `policy` can need: its cameras at up to 1080p float32
    (`MAX_IMAGE_BYTES`), plus 1 MiB for state, prompt, noise and framing; at most the 64 MiB default."""
    try:
        cameras = len(policy.frontend.describe().get("cameras") or []) or 1
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_MAX_MESSAGE_BYTES
    return min(DEFAULT_MAX_MESSAGE_BYTES, cameras * MAX_IMAGE_BYTES + 2**20)


class _ByteBudget:
    """Bytes of messages held at once across connections; `take` refuses (False) beyond the budget."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = int(limit), 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class PolicyServer:
    """Serve `policy` over websockets (module docstring). `start()` runs it on a background thread
    (tests, notebooks); `serve_forever()` blocks (the CLI). `port=0` picks a free port: read `.port`."""

    def __init__(self, policy: Any, host: str = "127.0.0.1", port: int = 8000,
                 max_message_bytes: int | None = None, metadata: Mapping[str, Any] | None = None,
                 max_connections: int = 32, max_bytes_held: int | None = None) -> None:
        from websockets.sync.server import serve

        self.policy = policy
        self.max_message_bytes = int(max_message_bytes or message_limit(policy))
        self.max_connections = int(max_connections)
        # a held message costs its bytes and its decoded copy
        self._budget = _ByteBudget(max_bytes_held or 4 * 2 * self.max_message_bytes)
        self._open = 0
        self._open_lock = threading.Lock()
        self.metadata = dict(metadata) if metadata is not None else policy_metadata(policy)
        self._hello = packb(self.metadata)
        self.served = 0
        self.errors = 0
        self._server = serve(self._handle, host, port, max_size=self.max_message_bytes, compression=None,
                             process_request=self._health)
        self._thread: threading.Thread | None = None
        self._requests: queue.Queue[tuple[Any, Future] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="flashrt-policy-server-worker", daemon=True)
        self._worker.start()

    @property
    def port(self) -> int:
        return self._server.socket.getsockname()[1]

    @property
    def host(self) -> str:
        return self._server.socket.getsockname()[0]

    # ------------------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        self._thread = self._thread or threading.current_thread()
        self._server.serve_forever()

    def start(self) -> PolicyServer:
        self._thread = threading.Thread(target=self.serve_forever, name="flashrt-policy-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, close open connections, wait for their handlers (idempotent)."""
        if self._thread is None:  # never served: websockets' shutdown() would wait for serve_forever
            self._server.socket.close()
        else:
            self._server.shutdown()
            if self._thread is not threading.current_thread():  # serve_forever() interrupted here
                self._thread.join(timeout=10)
        self._requests.put(None)
        self._worker.join(timeout=10)

    def _work(self) -> None:
        """The one caller of the policy: requests of every connection, in arrival order."""
        while (item := self._requests.get()) is not None:
            message, future = item
            if future.set_running_or_notify_cancel():
                future.set_result(self._answer(*message))

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ protocol
    @staticmethod
    def _health(connection: Any, request: Any) -> Any:
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        return None

    def _handle(self, ws: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        with self._open_lock:
            admitted = self._open < self.max_connections
            self._open += admitted
        if not admitted:
            ws.close(CLOSE_TRY_AGAIN_LATER, f"server busy: {self.max_connections} connections open")
            return
        try:
            ws.send(self._hello)
            prev_total_ms = None
            for message in ws:
                start = time.perf_counter()
                reply, fatal = self._request(message, prev_total_ms)
                ws.send(reply)
                if fatal:
                    ws.close(CLOSE_INTERNAL_ERROR, "internal server error")
                    return
                prev_total_ms = (time.perf_counter() - start) * 1e3
        except ConnectionClosed:
            return
        finally:
            with self._open_lock:
                self._open -= 1

    def _request(self, message: Any, prev_total_ms: float | None) -> tuple[bytes | str, bool]:
        """Decode on this connection's thread (within the byte budget), infer on the worker."""
        cost = 2 * len(message)
        if not self._budget.take(cost):
            self.errors += 1
            return (f"WireError: server busy: {self._budget.held} bytes of messages held "
                    f"(limit {self._budget.limit}); retry", False)
        try:
            try:
                obs = coerce(unpackb(message, self.max_message_bytes))
            except WireError as exc:
                self.errors += 1
                return f"WireError: {exc}", False
            future: Future = Future()
            self._requests.put(((obs, prev_total_ms), future))
            return future.result()
        finally:
            self._budget.give(cost)

    def _answer(self, obs: Any, prev_total_ms: float | None) -> tuple[bytes | str, bool]:
        """(reply, close after it): actions as msgpack, or an error as text."""
        try:
            reply = self._infer(obs)
        except (WireError, FlashRTError) as exc:
            self.errors += 1
            return f"{type(exc).__name__}: {exc}", False
        except Exception as exc:  # a bug: say so, then close this connection (the server lives on)
            self.errors += 1
            return f"internal error: {type(exc).__name__}: {exc}", True
        if prev_total_ms is not None:
            reply["server_timing"]["prev_total_ms"] = prev_total_ms
        self.served += 1
        return packb(reply), False

    def _infer(self, obs: Any) -> dict[str, Any]:
        from flashrt.errors import InputError

        if not isinstance(obs, dict):
            raise InputError(f"an observation must be a map, got {type(obs).__name__}")
        obs = dict(obs)
        seed, noise = obs.pop("seed", None), obs.pop("noise", None)
        start = time.perf_counter()
        out = self.policy.infer(obs, noise=noise, seed=seed)
        infer_ms = (time.perf_counter() - start) * 1e3
        timing = {k: float(v) for k, v in out.get("timing", {}).items()}
        return {"actions": out["actions"], "policy_timing": timing, "server_timing": {"infer_ms": infer_ms}}
