"""`flashrt serve-policy PATH [--host 127.0.0.1 --port 8000]`: the openpi-compatible policy server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["serve_policy"]


def serve_policy(
    path: Annotated[str, typer.Argument(help="a policy checkpoint folder (lerobot or openpi layout), or a "
                                        "hub id in the local Hugging Face cache")],
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port)")] = 8000,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    precision: Annotated[str, typer.Option(help="float32, bfloat16, float16")] = "float32",
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer file (Pi0: PaliGemma .model)")] = None,
    max_message_mb: Annotated[float | None, typer.Option(
        help="largest observation message accepted, MiB (default: what the policy's cameras can need "
             "at 1080p float32, at most 64)")] = None,
    max_connections: Annotated[int, typer.Option(help="connections open at once; more are refused")] = 32,
    max_held_mb: Annotated[float | None, typer.Option(
        help="messages being decoded or waiting for the policy, all connections together, MiB; beyond "
             "it a request is answered server_busy (default: 4 of the largest messages, decoded)")] = None,
    embodiment: Annotated[str | None, typer.Option(help="GROOT: the embodiment tag (or its id)")] = None,
) -> None:
    """Serve one policy to openpi-client over websockets (msgpack + numpy, metadata on connect)."""
    from flashrt.errors import ConfigError
    from flashrt.runner.policy import cli_options, load_policy
    from flashrt.serve.policy_server import PolicyServer

    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    if max_message_mb is not None and not 0 < max_message_mb <= 4096:
        raise ConfigError(f"--max-message-mb {max_message_mb} must lie in (0, 4096]")
    if max_connections < 1:
        raise ConfigError(f"--max-connections {max_connections} must be at least 1")
    if max_held_mb is not None and not 0 < max_held_mb <= 2**20:
        raise ConfigError(f"--max-held-mb {max_held_mb} must lie in (0, 1048576]")
    from flashrt.io.hub import resolve_checkpoint

    policy = load_policy(resolve_checkpoint(path), device=device, precision=precision,
                         **cli_options(tokenizer, embodiment))
    limit = None if max_message_mb is None else int(max_message_mb * 2**20)
    held = None if max_held_mb is None else int(max_held_mb * 2**20)
    server = PolicyServer(policy, host, port, max_message_bytes=limit, max_connections=max_connections,
                          max_bytes_held=held)
    typer.echo(f"flashrt serve-policy: {path} on ws://{server.host}:{server.port} (GET /healthz; messages "
               f"up to {server.max_message_bytes / 2**20:.1f} MiB)", err=True)
    try:
        server.serve_forever()
    finally:
        server.close()
