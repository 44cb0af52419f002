"""`flashrt serve --voice NAME [--voice ...] [--port 8000]`: the speech server on 127.0.0.1."""

from __future__ import annotations

from typing import Annotated

import typer

from flashrt.runner.tts import SnacNoiseOpt

__all__ = ["serve"]


def serve(
    voice: Annotated[
        list[str] | None,
        typer.Option("--voice", "--model", "-v", help="a voice/model to load (repeat for several)"),
    ] = None,
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    max_pending: Annotated[int, typer.Option(help="requests held at once; more get 503")] = 16,
    queue_size: Annotated[int, typer.Option(help="audio chunks buffered per request link")] = 4,
    warmup: Annotated[
        bool,
        typer.Option(
            help="speak one short text per voice before serving (the first "
            "call of each shape pays its kernel setup)"
        ),
    ] = True,
    snac_noise: SnacNoiseOpt = None,
) -> None:
    """Serve POST /v1/audio/speech, GET /v1/models and GET /health (OpenAI-compatible)."""
    import uvicorn

    from flashrt.runner.tts import load_tts, snac_options
    from flashrt.runtime.device import resolve_device
    from flashrt.serve.app import ServerLimits, SpeechServer, build_app

    check_options(port, max_pending, queue_size)  # before any voice loads: bad flags fail at once
    resolve_device(device)
    voices = {}
    for source in voice or ["en_US-joe-medium"]:
        model = load_tts(source, device=device, **snac_options(snac_noise))
        voices[getattr(model, "name", "") or source] = model
        if warmup:
            for _ in model.stream("Ready."):
                pass
    server = SpeechServer(voices, ServerLimits(max_pending=max_pending, queue_size=queue_size))
    typer.echo(f"flashrt serve: voices {sorted(voices)} on http://{host}:{port}")
    try:
        uvicorn.run(build_app(server), host=host, port=port, log_level="warning")
    finally:
        server.close()


def check_options(port: int, max_pending: int, queue_size: int) -> None:
    """ConfigError naming the flag when a value cannot work (uvicorn would fail on it after the load)."""
    from flashrt.errors import ConfigError

    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    for flag, value in (("--max-pending", max_pending), ("--queue-size", queue_size)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
