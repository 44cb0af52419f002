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
other clients (their pings and requests go on); inference runs on one worker thread (the only caller of
the policy), in arrival order.

Batching (several robots, one replay): when the policy was loaded with batch buckets
(`Policy.batches`, e.g. (1, 2, 4); `flashrt serve-policy --max-batch 4`), the worker takes the first
waiting request, then whatever else arrives within ``batch_window_ms`` (default 2 ms; it stops waiting
as soon as every open connection has a request in, or ``max_batch`` are taken) and runs them with
`Policy.infer_batch`: each request is checked on its own first (a bad observation gets its own error
reply and never fails the others), the good ones share one replay of the smallest batch bucket that
holds them, each in its own row with its own noise, and each reply goes to its own connection with
the actions that request gets alone (up to float rounding). A lone request runs exactly as
`Policy.infer`. A policy that cannot batch (`Policy.cannot_batch` says why) is served one request at
a time. `rounds` counts the requests taken per worker round; ``server_timing["batch"]`` tells a client
how many requests shared its replay. A client that disconnects while its request runs
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
from collections import Counter
from collections.abc import Mapping, Sequence
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
DEFAULT_BATCH_WINDOW_MS = 2.0  # how long the worker waits for more robots' requests to batch with the first
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
                 max_connections: int = 32, max_bytes_held: int | None = None, max_batch: int | None = None,
                 batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS) -> None:
        from websockets.sync.server import serve

        self.policy = policy
        self.max_message_bytes = int(max_message_bytes or message_limit(policy))
        self.max_connections = int(max_connections)
        if self.max_message_bytes < 1 or self.max_connections < 1:
            raise ConfigError(f"max_message_bytes ({self.max_message_bytes}) and max_connections "
                              f"({self.max_connections}) must be positive")
        self.max_batch, self.batch_window_s = _batching(policy, max_batch, batch_window_ms)
        self.rounds: Counter[int] = Counter()  # worker rounds by the number of requests taken
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
        """The one caller of the policy: requests of every connection, in arrival order, those that
        arrive together (`_collect`) batched."""
        stop = False
        while not stop and (first := self._requests.get()) is not None:
            items, stop = self._collect(first)
            live = [(message, future) for message, future in items if future.set_running_or_notify_cancel()]
            if not live:
                continue
            self.rounds[len(live)] += 1
            if len(live) == 1:
                live[0][1].set_result(self._answer(*live[0][0]))
                continue
            for (_, future), reply in zip(live, self._answer_batch([m for m, _ in live])):
                future.set_result(reply)

    def _collect(self, first: Any) -> tuple[list[Any], bool]:
        """`first` and the requests that arrive within the batch window, up to `max_batch` and no more
        than the open connections can send (each has at most one request in); (items, closing)."""
        items, deadline = [first], time.monotonic() + self.batch_window_s
        while len(items) < min(self.max_batch, max(self._open, 1)):
            wait = deadline - time.monotonic()
            try:
                item = self._requests.get(timeout=wait) if wait > 0 else self._requests.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        return items, False

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
            request = _request_of(obs)
            start = time.perf_counter()
            out = self.policy.infer(request.obs, noise=request.noise, seed=request.seed)
        except Exception as exc:
            return self._refusal(exc)
        return self._reply(out, (time.perf_counter() - start) * 1e3, prev_total_ms)

    def _answer_batch(self, messages: Sequence[tuple[Any, float | None]]) -> list[tuple[bytes | str, bool]]:
        """`_answer` of several requests with one `Policy.infer_batch`: each checked on its own (the
        server's keys here, the observation in the policy), each reply its own."""
        replies: list[Any] = [None] * len(messages)
        requests = []
        for k, (obs, _) in enumerate(messages):
            try:
                requests.append((k, _request_of(obs)))
            except Exception as exc:
                replies[k] = self._refusal(exc)
        start = time.perf_counter()
        try:
            outs = self.policy.infer_batch([request for _, request in requests]) if requests else []
        except Exception as exc:  # a bug of the batch as a whole: every request in it says so
            outs = [exc] * len(requests)
        infer_ms = (time.perf_counter() - start) * 1e3
        for (k, _), out in zip(requests, outs):
            replies[k] = self._refusal(out) if isinstance(out, BaseException) else \
                self._reply(out, infer_ms, messages[k][1])
        return replies

    def _refusal(self, exc: BaseException) -> tuple[str, bool]:
        """The error reply of a refused request; a bug (not a flashrt or wire error) also closes its
        connection (the server lives on)."""
        self.errors += 1
        if isinstance(exc, WireError | FlashRTError):
            return error_reply(error_code(exc), type(exc).__name__, str(exc)), False
        return error_reply(INTERNAL_ERROR, type(exc).__name__, f"internal error: {exc}"), True

    def _reply(self, out: Mapping[str, Any], infer_ms: float,
               prev_total_ms: float | None) -> tuple[bytes, bool]:
        """The actions reply: the policy's timing, the server's (``batch``: requests in its replay)."""
        timing = {k: float(v) for k, v in out.get("timing", {}).items()}
        server: dict[str, Any] = {"infer_ms": infer_ms, "batch": int(out.get("rows", 1))}
        if prev_total_ms is not None:
            server["prev_total_ms"] = prev_total_ms
        self.served += 1
        return packb({"actions": out["actions"], "policy_timing": timing, "server_timing": server}), False


def _request_of(obs: Any) -> Any:
    """The policy request of a decoded message: the observation, the server's keys (``seed``,
    ``noise``) taken out; WireError / InputError when they are malformed."""
    from flashrt.runner.policy import Request

    if not isinstance(obs, dict):
        raise InputError(f"an observation must be a map, got {type(obs).__name__}")
    obs = dict(obs)
    seed, noise = obs.pop("seed", None), obs.pop("noise", None)
    if noise is not None and not isinstance(noise, np.ndarray):  # a list, a map, text: not an array
        raise WireError(f"noise must be a numeric array (or absent), got {type(noise).__name__}",
                        "invalid_observation")
    return Request(obs, noise, seed)


def _batching(policy: Any, max_batch: int | None, window_ms: float) -> tuple[int, float]:
    """(requests one worker round takes at most, batch window in s): `max_batch` (None: the policy's
    largest batch bucket), never more than the policy batches; 1 for a policy that cannot batch."""
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                  or max_batch < 1):
        raise ConfigError(f"max_batch must be a positive int, got {max_batch!r}")
    if not 0 <= window_ms <= 1000:
        raise ConfigError(f"batch_window_ms {window_ms} must lie in [0, 1000]")
    largest = int(getattr(policy, "max_batch", 1))
    return min(largest, max_batch or largest), window_ms / 1e3
