"""The `flashrt` command: `info`, `cache`, `demo`, and the benchmarking commands.

Sub-applications live next to what they drive (`flashrt.quant.cli`, `flashrt.bench.cli`) and are
mounted here from one table; heavy imports (frontends, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import json
import sys
from importlib import import_module
from typing import Annotated

import typer

app = typer.Typer(help="flashrt: set up once, replay forever.", no_args_is_help=True,
                  pretty_exceptions_enable=False)

# (module, attribute, command name): Typer sub-applications mounted as `flashrt <name> ...`.
SUB_APPS: tuple[tuple[str, str, str], ...] = (
    ("flashrt.quant.cli", "cache_app", "cache"),
)
# (module, attribute): plain Typer commands registered on the main app (`flashrt <function name>`).
COMMANDS: tuple[tuple[str, str], ...] = (
    ("flashrt.demo", "demo"),
    ("flashrt.bench.cli", "bench"),
    ("flashrt.bench.cli", "loop"),
    ("flashrt.bench.cli", "soak"),
    ("flashrt.tts", "say"),
)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("flashrt", "torch", "numpy", "safetensors", "nvtx", "cuda", "tensorrt", "onnxruntime"):
        try:
            out[name] = getattr(import_module(name), "__version__", "installed")
        except ImportError:
            out[name] = None
    return out


@app.command()
def info(
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Device, architecture, versions, available graph backends and the calibration cache folder."""
    from flashrt.quant.cache import default_root
    from flashrt.runtime.device import describe_device

    report = {"device": describe_device(device), "versions": _versions(), "cache_dir": str(default_root())}
    if as_json:
        typer.echo(json.dumps(report, default=str))
        return
    for section, values in report.items():
        if isinstance(values, dict):
            typer.echo(f"{section}:")
            for k, v in values.items():
                typer.echo(f"  {k:14} {v}")
        else:
            typer.echo(f"{section}: {values}")


def _mount() -> None:
    for module, attr, name in SUB_APPS:
        app.add_typer(getattr(import_module(module), attr), name=name)
    for module, attr in COMMANDS:
        app.command()(getattr(import_module(module), attr))


_mount()


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
