"""`flashrt serve --ray` and `flashrt serve-policy --ray`: deploy (or write the Serve config of) an app
and serve it until interrupted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from flashrt.errors import ConfigError
from flashrt.integrations.ray_serve.apps import PolicyApp, SpeechApp, StageScale, parse_count, parse_replicas
from flashrt.integrations.ray_serve.deploy import (
    deploy_policy,
    deploy_speech,
    init_local,
    serve_api,
    serve_config,
)


def _write_config(app: SpeechApp | PolicyApp, path: Path, host: str, port: int, command: str) -> None:
    import typer
    import yaml  # a dependency of ray

    path.write_text(yaml.safe_dump(serve_config(app, host, port), sort_keys=False))
    typer.echo(f"{command}: wrote {path} (serve deploy {path})")


def _serve_until_interrupted(deploy: Any, *, host: str, port: int, address: str | None, line: str) -> None:
    """Join the cluster at ``address`` (None: start a local one, `init_local`), start Serve's HTTP proxy
    on ``host:port``, run ``deploy()``, print ``line`` and serve until interrupted; Serve and the Ray
    connection are shut down on every way out."""
    import time

    import ray
    import typer

    if address is None:
        init_local()  # Serve's HTTP proxy binds ``host`` alone
    else:
        ray.init(address=address)
    serve = serve_api()
    try:
        serve.start(http_options={"host": host, "port": port})
        deploy()
        typer.echo(line)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def policy_command(folder: str, options: dict[str, Any], *, host: str, port: int, address: str | None,
                   replicas: str, write_config: Path | None) -> None:
    """`flashrt serve-policy --ray`: the policy at `folder` as a `PolicyApp` (``replicas``: a count);
    with ``write_config`` its Serve config written there (nothing started), else deployed as
    `serve_command` does, the openpi websocket at ``ws://host:port/``."""
    app = PolicyApp(str(Path(folder).resolve()), options, StageScale(**parse_count(replicas or "1")))
    if write_config is not None:
        _write_config(app, write_config, host, port, "flashrt serve-policy")
        return
    _serve_until_interrupted(lambda: deploy_policy(app), host=host, port=port, address=address,
                             line=f"flashrt serve-policy: {Path(folder).name} on Ray Serve at "
                                  f"ws://{host}:{port} (POST /infer; Ctrl-C stops)")


def serve_command(voices: dict[str, str], options: dict[str, Any], limits: Any, *, host: str, port: int,
                  address: str | None, replicas: str, write_config: Path | None,
                  api_key: str | None = None) -> None:
    """`flashrt serve --ray`: one Orpheus-style voice as a `SpeechApp`; with ``write_config`` its Serve
    config written there (nothing started), else deployed on the cluster at ``address`` (None: a local
    one; Ray puts its own node on the machine's routable address, never a loopback one) and served on
    ``host:port`` until interrupted. ``api_key``: the ingress wants it on /v1/ routes (a written config
    never holds one: refused)."""
    if len(voices) != 1:
        raise ConfigError(f"--ray serves one voice (an Orpheus-style folder), got {sorted(voices) or 'none'}")
    (name, folder), = voices.items()
    counts = parse_replicas(replicas)
    scales = {stage: replace(getattr(SpeechApp, stage), **counts[stage]) for stage in counts}
    app = SpeechApp(str(Path(folder).resolve()), name, options, limits=limits, api_key=api_key, **scales)
    if write_config is not None:
        _write_config(app, write_config, host, port, "flashrt serve")
        return
    _serve_until_interrupted(lambda: deploy_speech(app), host=host, port=port, address=address,
                             line=f"flashrt serve: voice {name!r} on Ray Serve at http://{host}:{port} "
                                  "(Ctrl-C stops)")
