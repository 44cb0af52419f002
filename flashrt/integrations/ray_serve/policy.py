"""The policy deployment: `PolicyIngress` (openpi websocket, POST /infer, GET /health)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from flashrt.errors import FlashRTError
from flashrt.integrations.ray_serve.apps import set_threads
from flashrt.integrations.ray_serve.batcher import Batcher


class PolicyIngress:
    """A policy's routes at its application's root (a Serve ASGI ingress, `policy_app`):

        websocket      the openpi protocol of `flashrt serve-policy` (`flashrt.serve.policy_server`): the
                       metadata map first, then each binary msgpack observation answered with msgpack
                       ``{"actions", "policy_timing", "server_timing"}`` or a text error; an internal
                       error closes the connection with 1011, every other error keeps it
        POST /infer    one observation -> the same msgpack reply, or the error as JSON (400 / 500)
        GET /health    the policy's metadata

    One worker thread runs the policy (the only caller of it, as in `flashrt serve-policy`). A policy
    loaded with batch buckets (``options["batches"]``, `flashrt serve-policy --ray --max-batch`) serves
    the requests waiting for the worker when it comes free together, up to `Policy.max_batch`, with one
    `Policy.infer_batch` (each request checked alone, its own actions, its own error); a lone request runs
    exactly as `Policy.infer`. No window is waited for more; `rounds` counts requests per run."""

    def __init__(self, folder: str, options: dict[str, Any], threads: int) -> None:
        from flashrt.runner.policy import load_policy
        from flashrt.serve.policy_server import message_limit, policy_metadata
        from flashrt.serve.wire import packb

        set_threads(threads)
        self.policy = load_policy(folder, **options)
        self.max_bytes = message_limit(self.policy)
        self.hello = packb(policy_metadata(self.policy))
        self.batcher = Batcher(self._run, self.policy.max_batch, "policy")

    @property
    def rounds(self) -> Counter[int]:
        """Requests per run of the policy (`Batcher.rounds`)."""
        return self.batcher.rounds

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app (Serve calls this once the replica is constructed): a websocket on any path of
        the application (as `flashrt serve-policy` takes any), the HTTP routes by path."""
        from starlette.applications import Starlette
        from starlette.routing import Route
        from starlette.websockets import WebSocket

        http = Starlette(routes=[Route("/infer", self._http_infer, methods=["POST"]),
                                 Route("/health", self._health, methods=["GET"])])

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "websocket":
                return await self._websocket(WebSocket(scope, receive, send))
            return await http(scope, receive, send)

        return app

    async def _http_infer(self, request: Any) -> Any:
        from starlette.responses import Response

        status, body = await self._answer(await request.body(), None)
        kind = "application/msgpack" if status == 200 else "application/json"
        return Response(body, status_code=status, media_type=kind)

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from flashrt.serve.policy_server import _no_paths, policy_metadata

        return JSONResponse({"status": "ok", "policy": _no_paths(policy_metadata(self.policy))})

    async def _websocket(self, ws: Any) -> None:
        """One openpi client: metadata, then requests answered in turn (`flashrt serve-policy`'s replies)."""
        import time

        from starlette.websockets import WebSocketDisconnect

        from flashrt.serve.policy_server import CLOSE_INTERNAL_ERROR

        await ws.accept()
        try:
            await ws.send_bytes(self.hello)
            prev_total_ms = None
            while (message := await ws.receive())["type"] != "websocket.disconnect":
                start = time.perf_counter()
                data = message.get("bytes")
                status, reply = await self._answer(data if data is not None else message.get("text"),
                                                      prev_total_ms)
                await (ws.send_bytes(reply) if isinstance(reply, bytes) else ws.send_text(reply))
                if status == 500:
                    await ws.close(CLOSE_INTERNAL_ERROR, "internal server error")
                    return
                prev_total_ms = (time.perf_counter() - start) * 1e3
        except WebSocketDisconnect:
            return

    async def _answer(self, message: Any, prev_total_ms: float | None) -> tuple[int, bytes | str]:
        """(status, reply): msgpack actions, or an error reply (400 refused, 500 a bug)."""
        import time

        from flashrt.serve.policy_server import INTERNAL_ERROR, _request_of, error_code, error_reply
        from flashrt.serve.wire import WireError, coerce, packb, unpackb

        start = time.perf_counter()
        try:
            out = await self.batcher(_request_of(coerce(unpackb(message, self.max_bytes))))
        except (WireError, FlashRTError) as exc:
            return 400, error_reply(error_code(exc), type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug answers 500; the replica keeps serving
            return 500, error_reply(INTERNAL_ERROR, type(exc).__name__, f"internal error: {exc}")
        infer_ms = (time.perf_counter() - start) * 1e3
        timing = {k: float(v) for k, v in out.get("timing", {}).items()}
        server: dict[str, Any] = {"infer_ms": infer_ms, "batch": int(out.get("rows", 1))}
        if prev_total_ms is not None:
            server["prev_total_ms"] = prev_total_ms
        return 200, packb({"actions": out["actions"], "policy_timing": timing, "server_timing": server})

    def _run(self, requests: list[Any]) -> list[Any]:
        """Each request's result or exception: one alone exactly as `Policy.infer`, several with one
        `Policy.infer_batch`."""
        if len(requests) > 1:
            return self.policy.infer_batch(requests)
        request = requests[0]
        try:
            return [self.policy.infer(request.obs, noise=request.noise, seed=request.seed)]
        except Exception as exc:  # noqa: BLE001 - the request's own error, answered to it
            return [exc]

    def check_health(self) -> None:
        self.batcher.check_health()
