"""`flashrt serve-policy PATH [--host 127.0.0.1 --port 8000]`: the openpi-compatible policy server.

Several robots: requests arriving within ``--batch-window-ms`` (default 2) run as one replay of up to
``--max-batch`` observations (default 4: batch buckets 1, 2, 4 captured at load) where the family
batches (Pi0 / Pi0.5); a family that cannot (GROOT, Pi0-FAST) is served one request at a time, and the
command says so. ``--max-batch 1`` serves every family one request at a time.

``--ray [--address ADDR] [--replicas N|MIN-MAX]`` deploys the policy on Ray Serve instead (the same
protocol at the application's root, `flashrt.integrations.ray_serve.PolicyIngress`, each replica
batching up to ``--max-batch`` as here); ``--write-config PATH`` writes Serve's YAML config for ``serve
deploy`` and exits."""

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
    max_batch: Annotated[int, typer.Option(
        help="robots' requests one replay serves at most (batch buckets: powers of two up to it, captured "
             "at load; 1: one request at a time)")] = 4,
    batch_window_ms: Annotated[float, typer.Option(
        help="how long a request waits for others to share its replay, ms")] = 2.0,
    ray: Annotated[bool, typer.Option(
        "--ray", help="deploy on Ray Serve instead (flashrt.integrations.ray_serve): the openpi websocket "
        "at the root and POST /infer; a replica batches the requests waiting for it, up to --max-batch")
    ] = False,
    address: Annotated[str | None, typer.Option(
        help="with --ray: the Ray cluster to join (default: start a local one on 127.0.0.1)")] = None,
    replicas: Annotated[str, typer.Option(
        help="with --ray: replicas of the policy deployment, N or MIN-MAX (autoscaling)")] = "1",
    write_config: Annotated[Path | None, typer.Option(
        help="with --ray: write Serve's YAML config (for 'serve deploy') to this path and exit")] = None,
) -> None:
    """Serve one policy to openpi-client over websockets (msgpack + numpy, metadata on connect)."""
    from flashrt.errors import ConfigError
    from flashrt.runner.policy import batch_ladder, cli_options, detect_family, load_policy
    from flashrt.runtime.heap import settle
    from flashrt.serve.policy_server import PolicyServer

    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    if not 1 <= max_batch <= 64:
        raise ConfigError(f"--max-batch {max_batch} must lie in 1..64")
    if ray or write_config is not None:
        from flashrt.integrations.ray_serve import policy_command
        from flashrt.io.hub import resolve_checkpoint

        folder = resolve_checkpoint(path)
        family = detect_family(folder)
        batched = "batches" in family.options and max_batch > 1
        options = {"device": device, "precision": precision, "family": family.name,
                   **({"batches": list(batch_ladder(max_batch))} if batched else {}),
                   **cli_options(tokenizer, embodiment)}
        policy_command(str(folder), options, host=host, port=port, address=address, replicas=replicas,
                       write_config=write_config)
        return
    if max_message_mb is not None and not 0 < max_message_mb <= 4096:
        raise ConfigError(f"--max-message-mb {max_message_mb} must lie in (0, 4096]")
    if max_connections < 1:
        raise ConfigError(f"--max-connections {max_connections} must be at least 1")
    if max_held_mb is not None and not 0 < max_held_mb <= 2**20:
        raise ConfigError(f"--max-held-mb {max_held_mb} must lie in (0, 1048576]")
    if not 0 <= batch_window_ms <= 1000:
        raise ConfigError(f"--batch-window-ms {batch_window_ms} must lie in [0, 1000]")
    from flashrt.io.hub import resolve_checkpoint

    folder = resolve_checkpoint(path)
    family = detect_family(folder)
    batches = batch_ladder(max_batch) if "batches" in family.options and max_batch > 1 else None
    policy = load_policy(folder, device=device, precision=precision, family=family.name, batches=batches,
                         **cli_options(tokenizer, embodiment))
    if policy.cannot_batch:
        typer.echo(f"flashrt serve-policy: one request at a time ({policy.cannot_batch})", err=True)
    typer.echo(f"flashrt serve-policy: {settle().summary()}", err=True)
    limit = None if max_message_mb is None else int(max_message_mb * 2**20)
    held = None if max_held_mb is None else int(max_held_mb * 2**20)
    server = PolicyServer(policy, host, port, max_message_bytes=limit, max_connections=max_connections,
                          max_bytes_held=held, max_batch=max_batch, batch_window_ms=batch_window_ms)
    typer.echo(f"flashrt serve-policy: {path} on ws://{server.host}:{server.port} (GET /healthz; messages "
               f"up to {server.max_message_bytes / 2**20:.1f} MiB)", err=True)
    try:
        server.serve_forever()
    finally:
        server.close()
