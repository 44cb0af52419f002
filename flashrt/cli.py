"""The `flashrt` command: `info`, `cache`, `demo`, and the benchmarking commands.

Sub-applications live next to what they drive (`flashrt.quant.cli`, `flashrt.bench.cli`) and are
mounted here from one table; heavy imports (frontends, matplotlib) happen inside the commands.

Errors (`run_app`, used by `main` and the stand-alone bench entry): a user error -- any flashrt error
(bad device, profile, checkpoint, input), a file that cannot be read or written (OSError), a bad
argument value (ValueError) -- prints ONE line on stderr, ``flashrt: error: <what> (<what to do>)``,
and exits with code 2. Anything else is a bug in flashrt: one line saying so, exit code 1. The
traceback is printed only with ``--debug`` (anywhere on the command line).
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
    ("flashrt.runner.tts", "say"),
    ("flashrt.serve.cli", "serve"),
    ("flashrt.calibrate", "calibrate"),
    ("flashrt.export", "export"),
    ("flashrt.serve.policy_cli", "serve_policy"),
    ("flashrt.bench.kernels", "kernels"),
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


def _print_version(value: bool) -> None:
    if value:
        from flashrt import __version__

        typer.echo(f"flashrt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="print the traceback of an error")] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True,
                                         help="log progress (-v: load, capture, calibration; -vv: all)")] = 0,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print flashrt's version and exit")] = False,
) -> None:
    """flashrt: set up once, replay forever."""  # --debug is taken off the command line by run_app
    if verbose:
        import logging

        logging.basicConfig(level=logging.INFO if verbose == 1 else logging.DEBUG,
                            format="flashrt %(levelname)s %(name)s: %(message)s")


USER_ERROR_EXIT, BUG_EXIT = 2, 1
_HINTS: tuple[tuple[str, str], ...] = (  # (exception class name in the MRO, what to do), first match wins
    ("DeviceError", "`flashrt info` shows what this machine has"),
    ("CheckpointError", "check the checkpoint named above"),
    ("CalibrationError", "`flashrt cache verify` checks the calibration cache"),
    ("PermissionError", "check the permissions of that path, or choose another one"),
    ("FileNotFoundError", "check the path"),
    ("OSError", "check that the path exists, is the right kind of file and is readable or writable"),
)


# `flashrt bench <form> ...`: benchmarks with options of their own (not a registered frontend's), each a
# plain Typer command run in place of `bench` (module, attribute)
BENCH_FORMS: dict[str, tuple[str, str]] = {
    "serve": ("flashrt.bench.serve", "bench_serve"),
    "serve-policy": ("flashrt.bench.serve_policy", "bench_serve_policy"),
    "act-and-talk": ("flashrt.bench.act_talk", "bench_act_and_talk"),
}


def _bench_form(application: typer.Typer, args: list[str],
                prog_name: str) -> tuple[typer.Typer, list[str], str]:
    """The app, arguments and name to run: a `BENCH_FORMS` command for ``bench <form>``, else as given."""
    if application is app and len(args) >= 2 and args[0] == "bench" and args[1] in BENCH_FORMS:
        module, attribute = BENCH_FORMS[args[1]]
        form = typer.Typer(pretty_exceptions_enable=False)
        form.command()(getattr(import_module(module), attribute))
        return form, args[2:], f"{prog_name} bench {args[1]}"
    return application, args, prog_name


def run_app(application: typer.Typer, argv: list[str] | None = None, prog_name: str = "flashrt") -> int:
    """Run a Typer app; user errors become one line and exit code 2 (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    application, args, prog_name = _bench_form(application, args, prog_name)
    try:
        application(args=args, prog_name=prog_name, standalone_mode=True)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        typer.echo(f"{prog_name}: interrupted", err=True)
        return 130
    except Exception as exc:
        if debug:
            raise
        line, code = describe_error(exc)
        typer.echo(f"{prog_name}: {line}", err=True)
        return code
    return 0


def describe_error(exc: BaseException) -> tuple[str, int]:
    """(one line for the user, exit code) of an exception that escaped a command."""
    from flashrt.errors import FlashRTError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ModuleNotFoundError):
        from flashrt.extras import missing_package_hint

        hint = missing_package_hint(exc)
        if hint is not None:
            return f"error: {hint}", USER_ERROR_EXIT
    if isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {(exc.strerror or text).lower()}"
    if isinstance(exc, FlashRTError | OSError | ValueError):
        names = [c.__name__ for c in type(exc).__mro__]
        hint = next((h for name, h in _HINTS if name in names), "fix the value named above")
        return f"error: {text} ({hint}; --debug shows the traceback)", USER_ERROR_EXIT
    return (f"internal error: {type(exc).__name__}: {text} (a bug in flashrt; rerun with --debug for the "
            "traceback and report it)", BUG_EXIT)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    typer.echo(str(code), err=True)  # sys.exit("message") prints the message and exits 1
    return 1


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
