"""`flashrt serve --voice [NAME=]SOURCE [--voice ...] [--port 8000]`: the speech server on 127.0.0.1.

The port is bound before any voice loads: a busy port is one line and exit 2 in a second, not after
every voice was loaded and warmed; the "serving on" line comes only once the socket is bound and the
voices are ready. Clients see each voice by its name (``NAME=`` or the source's folder / file name),
never a path of this machine.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer

from flashrt.runner.tts import SnacNoiseOpt, VoicesDirOpt

__all__ = ["serve", "voice_name", "bind"]


def serve(
    voice: Annotated[
        list[str] | None,
        typer.Option("--voice", "--model", "-v",
                     help="a voice/model to load, as SOURCE or NAME=SOURCE (repeat for several)"),
    ] = None,
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    max_pending: Annotated[int, typer.Option(help="requests held at once; more get 503")] = 16,
    queue_size: Annotated[int, typer.Option(help="audio chunks buffered per request link")] = 4,
    send_timeout: Annotated[
        float, typer.Option(help="seconds a client may read nothing before its request is cancelled")
    ] = 30.0,
    ttfa_deadline_ms: Annotated[
        float | None,
        typer.Option(help="default deadline for a request's first audio: one that cannot meet it is "
                     "refused at once (503, Retry-After); a request may set its own ttfa_deadline_ms"),
    ] = None,
    warmup: Annotated[
        bool,
        typer.Option(
            help="speak one short text per voice before serving (the first "
            "call of each shape pays its kernel setup)"
        ),
    ] = True,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes (set it when binding beyond "
        "this machine)")] = None,
    snac_noise: SnacNoiseOpt = None,
    voices_dir: VoicesDirOpt = None,
    slots: Annotated[int | None, typer.Option(
        help="requests a voice serves at once [8]: an Orpheus-style voice decodes them together (its K/V "
        "cache rows), a Piper voice interleaves them chunk by chunk; 1 serves one after another")] = None,
    threads: Annotated[int | None, typer.Option(
        help="torch CPU threads per op, at most [torch's default: every core]; each voice picks its own from "
        "the cores free at load (an Orpheus-style voice shares them between its LM and SNAC stages)")] = None,
    decoder_precision: Annotated[str | None, typer.Option(
        "--decoder-precision", help="Piper voices: 'bf16' runs each voice's HiFi-GAN decoder in bfloat16 "
        "behind the float32 prior (~1.25x the throughput on CPUs with AVX512-BF16; not the float32 audio: "
        "docs/benchmarks/tts.md)")] = None,
    ray: Annotated[bool, typer.Option(
        "--ray", help="deploy on Ray Serve instead: the voice's lm and vocoder stages and the ingress as "
        "deployments (flashrt.integrations.ray_serve; one Orpheus-style voice)")] = False,
    address: Annotated[str | None, typer.Option(
        help="with --ray: the Ray cluster to join (default: start a local one on 127.0.0.1)")] = None,
    replicas: Annotated[str, typer.Option(
        help="with --ray: replicas per stage, e.g. lm=2,vocoder=1; MIN-MAX autoscales (lm=1-3)")] = "",
    write_config: Annotated[Path | None, typer.Option(
        help="with --ray: write Serve's YAML config (for 'serve deploy') to this path and exit")] = None,
) -> None:
    """Serve POST /v1/audio/speech, GET /v1/models, GET /health and GET /metrics (OpenAI-compatible)."""
    if (ray or write_config is not None) and decoder_precision is not None:
        from flashrt.errors import ConfigError

        raise ConfigError("--decoder-precision applies to Piper voices; --ray serves one Orpheus-style voice")
    if ray or write_config is not None:
        from flashrt.integrations.ray_serve import serve_command
        from flashrt.serve.app import ServerLimits

        check_options(port, max_pending, queue_size, send_timeout, ttfa_deadline_ms)
        if api_key is None and not _loopback(host) and write_config is None:
            typer.echo(f"flashrt serve: WARNING: {host} is reachable from other machines and no --api-key "
                       "is set: anyone who can connect may use this voice", err=True)
        limits = ServerLimits(max_pending=max_pending, queue_size=queue_size, send_timeout_s=send_timeout,
                              ttfa_deadline_ms=ttfa_deadline_ms)
        options = {"device": device, **({"slots": slots} if slots is not None else {}),
                   **({"snac_noise": snac_noise} if snac_noise is not None else {})}
        serve_command(named_sources(voice or []), options, limits, host=host, port=port, address=address,
                      replicas=replicas, write_config=write_config, api_key=api_key)
        return
    import uvicorn

    from flashrt.runner.tts import load_tts, snac_options
    from flashrt.runtime.device import resolve_device
    from flashrt.runtime.heap import settle
    from flashrt.serve.app import ServerLimits, SpeechServer, build_app

    check_options(port, max_pending, queue_size, send_timeout, ttfa_deadline_ms)  # before any voice loads
    if slots is not None and slots < 1 or threads is not None and threads < 1:
        from flashrt.errors import ConfigError

        raise ConfigError(f"--slots ({slots}) and --threads ({threads}) must be at least 1")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    resolve_device(device)
    sources = named_sources(voice or ["en_US-joe-medium"])
    if api_key is None and not _loopback(host):
        typer.echo(f"flashrt serve: WARNING: {host} is reachable from other machines and no --api-key is "
                   "set: anyone who can connect may use these voices", err=True)
    sock = bind(host, port)
    server = None
    try:
        voices = {}
        for name, source in sources.items():
            extra = {**snac_options(snac_noise), **({"slots": slots} if slots is not None else {}),
                     **({"decoder_precision": decoder_precision} if decoder_precision is not None else {})}
            model = load_tts(source, device=device, voices_dir=voices_dir, **extra)
            voices[name] = model
            if warmup:
                for _ in model.stream("Ready."):
                    pass
        typer.echo(f"flashrt serve: {settle().summary()}", err=True)
        limits = ServerLimits(max_pending=max_pending, queue_size=queue_size, send_timeout_s=send_timeout,
                              ttfa_deadline_ms=ttfa_deadline_ms)
        server = SpeechServer(voices, limits, api_key=api_key)
        bound = sock.getsockname()[1]
        typer.echo(f"flashrt serve: voices {sorted(voices)} on http://{host}:{bound}")
        config = uvicorn.Config(build_app(server), log_level="warning")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if server is not None:
            server.close()


def voice_name(source: str) -> str:
    """The name clients see for a voice given as `source`: its folder's or file's name (a model file's
    suffixes dropped: ``.../en_US-joe-medium.onnx`` -> ``en_US-joe-medium``), or a catalogue name as is."""
    path = Path(source)
    name = path.name
    if path.suffix in (".onnx", ".json", ".safetensors") or name.endswith(".onnx.json"):
        name = name.split(".")[0]
    return name


def named_sources(specs: list[str]) -> dict[str, str]:
    """{name: source} of ``--voice`` values (``NAME=SOURCE`` or ``SOURCE``); ConfigError on a clash."""
    from flashrt.errors import ConfigError

    named: dict[str, str] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep:
            name, source = voice_name(spec), spec
        if not name or not source or "/" in name or name in (".", ".."):
            raise ConfigError(f"--voice {spec!r}: give SOURCE or NAME=SOURCE with a NAME without '/'")
        if name in named:
            raise ConfigError(f"--voice: two voices are named {name!r} ({named[name]}, {source}); "
                              f"name them with NAME=SOURCE")
        named[name] = source
    return named


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or ConfigError at once when the port is taken."""
    from flashrt.errors import ConfigError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"--host {host}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                          f"(another server there? choose another --port)") from None
    sock.set_inheritable(True)
    return sock


def check_options(port: int, max_pending: int, queue_size: int, send_timeout: float = 30.0,
                  ttfa_deadline_ms: float | None = None) -> None:
    """ConfigError naming the flag when a value cannot work (uvicorn would fail on it after the load)."""
    from flashrt.errors import ConfigError

    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    for flag, value in (("--max-pending", max_pending), ("--queue-size", queue_size)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if not send_timeout > 0:
        raise ConfigError(f"--send-timeout {send_timeout} must be positive")
    if ttfa_deadline_ms is not None and not ttfa_deadline_ms > 0:
        raise ConfigError(f"--ttfa-deadline-ms {ttfa_deadline_ms} must be positive")
