"""An openpi-compatible websocket policy server over one flashrt `Policy`.

Speaks the protocol of openpi's ``WebsocketPolicyServer`` so the unmodified ``openpi-client``
(``WebsocketClientPolicy``, ``ActionChunkBroker``) drives a flashrt policy:

    connect            the server sends one binary message: the metadata map (msgpack)
    binary message     an observation map (msgpack with numpy arrays, `flashrt.serve.wire`)
    reply (binary)     {"actions": (chunk, action_dim) float32, "policy_timing": {..},
                        "server_timing": {"infer_ms": .., "prev_total_ms": ..}}
    reply (text)       an error: the client raises it (openpi's convention for errors)
    GET /healthz       200 "OK" (a plain HTTP probe on the same port)
    GET /metrics       Prometheus metrics, plain HTTP on the same port (`flashrt.serve.metrics`:
                       requests by outcome, step latency, connections, queue depth; 501 without
                       prometheus_client)

Observations are the ones `Policy.infer` takes (openpi style ``images`` / ``state`` / ``prompt`` or
lerobot keys). Two optional keys are a flashrt extension: ``seed`` (int) and ``noise`` (the family's
noise array) fix the randomness exactly as the in-process call does.

Errors: a refused message gets a text reply, a JSON object in the speech server's shape,
``{"error": {"code": .., "type": .., "message": ..}}`` (openpi-client raises it as a RuntimeError with
that text). ``code`` is machine-readable (`ERROR_CODES`):

    invalid_message       not msgpack, a text frame, a malformed array (`WireError`)
    unsupported_dtype     an array the policy cannot take without changing its values (`WireError`)
    invalid_observation   the observation is refused by the policy (`InputError`), or the server's own
                          keys (``seed``, ``noise``) are malformed
    invalid_request       a refused option (`ConfigError`)
    numerical_error       the policy produced non-finite actions (`NumericalError`)
    policy_error          any other flashrt error
    server_busy           the messages held at once would exceed ``max_bytes_held``: retry
    internal_error        a bug: the reply is followed by a close with 1011

Every reply but ``internal_error`` keeps the connection usable, and the next good request on it is
answered exactly as on a fresh connection. Arrays in a dtype the policy cannot take are converted
where no value changes (float16 -> float32, small integers -> float32, 0..255 integer images -> uint8,
`flashrt.serve.wire.coerce`), else refused (``unsupported_dtype``).

Resources: a message over ``max_message_bytes`` is refused by the websocket layer from its frame header,
before its payload is buffered or decoded (that connection is closed with 1009); the default limit
follows what the policy takes (`message_limit`: each camera frame at up to 1920x1080 float32, plus
1 MiB for state, prompt and noise; at most 64 MiB). At most ``max_connections`` are open (more are
closed at once with 1013, "try again later"), so received messages hold at most max_connections x
max_message_bytes; decoding one holds about `HELD_PER_BYTE` times its size, and the messages being
decoded or waiting for the worker stay within ``max_bytes_held`` (beyond it: ``server_busy``, the
connection stays). Messages are decoded on their own connection's thread, so a large one never stalls
other clients (their pings and requests go on); inference runs one request at a time, in arrival order,
on one worker thread (the only caller of the policy). A client that disconnects while its request runs
leaves the server healthy (the reply is dropped). Binds 127.0.0.1 unless told otherwise. The metadata
sent on connect names the checkpoint by its folder's name, never a path of the server.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from http import HTTPStatus
from typing import Any

import numpy as np

from flashrt.errors import ConfigError, FlashRTError, InputError, NumericalError
from flashrt.serve.wire import WireError, coerce, packb, unpackb

__all__ = ["PolicyServer", "policy_metadata", "message_limit", "error_reply", "ERROR_CODES",
           "DEFAULT_MAX_MESSAGE_BYTES"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
MAX_IMAGE_BYTES = 1920 * 1080 * 3 * 4  # one camera frame at 1080p in float32
HELD_PER_BYTE = 4  # a message being decoded: its bytes, msgpack's array bytes, the array copy, a conversion
DEFAULT_HELD_MESSAGES = 4  # max_bytes_held defaults to this many largest messages being decoded at once
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
SERVER_BUSY, INTERNAL_ERROR = "server_busy", "internal_error"
# the code of each refused request's error class (the most specific class listed wins)
ERROR_CODES: dict[type[BaseException], str] = {
    InputError: "invalid_observation",
    ConfigError: "invalid_request",
    NumericalError: "numerical_error",
    FlashRTError: "policy_error",
}


def error_code(exc: BaseException) -> str:
    """The machine-readable code of a refused request (`ERROR_CODES`; a WireError names its own)."""
    if isinstance(exc, WireError):
        return exc.code
    return next((ERROR_CODES[cls] for cls in type(exc).__mro__ if cls in ERROR_CODES), INTERNAL_ERROR)


def error_reply(code: str, kind: str, message: str) -> str:
    """The text reply of a refused request: ``{"error": {"code", "type", "message"}}`` as JSON."""
    return json.dumps({"error": {"code": code, "type": kind, "message": message}})


def reply_outcome(reply: bytes | str) -> str:
    """The outcome of a reply for the metrics: "ok" (actions), or the code of an error reply."""
    if not isinstance(reply, str):
        return "ok"
    try:
        return str(json.loads(reply)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return INTERNAL_ERROR


def _policy_metrics(server: PolicyServer) -> Any:
    """The server's `PolicyMetrics`, or None without prometheus_client (``/metrics`` then says so)."""
    from flashrt.serve import metrics

    return metrics.PolicyMetrics(server.load) if metrics.available() else None


def _metrics_response(policy_metrics: Any, connection: Any) -> Any:
    """``GET /metrics``: the exposition text with its content type, or 501 naming the extra."""
    from flashrt.serve import metrics

    if policy_metrics is None:
        return connection.respond(HTTPStatus.NOT_IMPLEMENTED, metrics.MISSING + "\n")
    body, content_type = policy_metrics.render()
    response = connection.respond(HTTPStatus.OK, body.decode())
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = content_type
    return response


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


# an absolute or home-relative path inside a string: at its start or after a space, quote, '=' or '('
_EMBEDDED_PATH = re.compile(r"(?:^|(?<=[\s=(\[\"']))(?:~|/)[^\s\"'()\[\],;]*")


def _no_paths(value: Any) -> Any:
    """A describe() nest with every path of this machine cut to its last part: a string that is an
    existing path, and any absolute or ``~`` path inside a string."""
    if isinstance(value, dict):
        return {k: _no_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_paths(v) for v in value]
    if not isinstance(value, str):
        return value
    if os.sep in value and os.path.exists(value):
        return _last_part(value)
    return _EMBEDDED_PATH.sub(lambda m: _last_part(m.group(0)), value)


def _last_part(path: str) -> str:
    return os.path.basename(path.rstrip(os.sep)) or "."


def message_limit(policy: Any) -> int:
    """The largest message an observation of `policy` can need: each of its camera frames (cameras x
    ``frames_per_camera``) at up to 1080p float32 (`MAX_IMAGE_BYTES`), plus 1 MiB for state, prompt,
    noise and framing; at most the 64 MiB default, which is also the limit of a policy that does not
    describe its cameras."""
    try:
        described = policy.frontend.describe()
        cameras = described.get("cameras")
        frames = int(described.get("frames_per_camera") or 1)
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_MAX_MESSAGE_BYTES
    count = len(cameras) if isinstance(cameras, list | tuple) else cameras
    if isinstance(count, bool) or not isinstance(count, int) or count < 1 or frames < 1:
        return DEFAULT_MAX_MESSAGE_BYTES
    return min(DEFAULT_MAX_MESSAGE_BYTES, count * frames * MAX_IMAGE_BYTES + 2**20)


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
        if self.max_message_bytes < 1 or self.max_connections < 1:
            raise ConfigError(f"max_message_bytes ({self.max_message_bytes}) and max_connections "
                              f"({self.max_connections}) must be positive")
        held = max_bytes_held or DEFAULT_HELD_MESSAGES * HELD_PER_BYTE * self.max_message_bytes
        self._budget = _ByteBudget(held)
        self._open = 0
        self._open_lock = threading.Lock()
        self.metadata = dict(metadata) if metadata is not None else policy_metadata(policy)
        self._hello = packb(self.metadata)
        self.served = 0
        self.errors = 0
        self.metrics = _policy_metrics(self)
        self._server = serve(self._handle, host, port, max_size=self.max_message_bytes, compression=None,
                             process_request=self._http)
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
    def _http(self, connection: Any, request: Any) -> Any:
        """Plain HTTP on the websocket port: ``/metrics``, ``/healthz``; None: go on with the handshake."""
        if request.path.partition("?")[0] == "/metrics":
            return _metrics_response(self.metrics, connection)
        return self._health(connection, request)

    def load(self) -> dict[str, int]:
        """What the server holds now: open connections, requests waiting for the policy, bytes held."""
        return {"connections": self._open, "queue_depth": self._requests.qsize(),
                "bytes_held": self._budget.held}

    def _observe(self, reply: bytes | str, start: float) -> None:
        if self.metrics is not None:
            self.metrics.answered(reply_outcome(reply), time.perf_counter() - start)

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
            if self.metrics is not None:
                self.metrics.refused.inc()
            ws.close(CLOSE_TRY_AGAIN_LATER, f"server busy: {self.max_connections} connections open")
            return
        try:
            ws.send(self._hello)
            prev_total_ms = None
            for message in ws:
                start = time.perf_counter()
                reply, fatal = self._request(message, prev_total_ms)
                ws.send(reply)
                self._observe(reply, start)
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
        cost = HELD_PER_BYTE * len(message)
        if not self._budget.take(cost):
            self.errors += 1
            return error_reply(SERVER_BUSY, "ServerBusy", f"{self._budget.held} bytes of messages held "
                               f"(limit {self._budget.limit}); retry"), False
        try:
            try:
                obs = coerce(unpackb(message, self.max_message_bytes))
            except WireError as exc:
                self.errors += 1
                return error_reply(exc.code, "WireError", str(exc)), False
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
            return error_reply(error_code(exc), type(exc).__name__, str(exc)), False
        except Exception as exc:  # a bug: say so, then close this connection (the server lives on)
            self.errors += 1
            return error_reply(INTERNAL_ERROR, type(exc).__name__, f"internal error: {exc}"), True
        if prev_total_ms is not None:
            reply["server_timing"]["prev_total_ms"] = prev_total_ms
        self.served += 1
        return packb(reply), False

    def _infer(self, obs: Any) -> dict[str, Any]:
        if not isinstance(obs, dict):
            raise InputError(f"an observation must be a map, got {type(obs).__name__}")
        obs = dict(obs)
        seed, noise = obs.pop("seed", None), obs.pop("noise", None)
        if noise is not None and not isinstance(noise, np.ndarray):  # a list, a map, text: not an array
            raise WireError(f"noise must be a numeric array (or absent), got {type(noise).__name__}",
                            "invalid_observation")
        start = time.perf_counter()
        out = self.policy.infer(obs, noise=noise, seed=seed)
        infer_ms = (time.perf_counter() - start) * 1e3
        timing = {k: float(v) for k, v in out.get("timing", {}).items()}
        return {"actions": out["actions"], "policy_timing": timing, "server_timing": {"infer_ms": infer_ms}}
