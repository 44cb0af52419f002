"""`flashrt calibrate PATH --recipe NAME [--samples N] [--data FILE]`: fill the calibration cache.

Loads the checkpoint with ``load_policy(PATH, precision=..., calibration=...)`` exactly as a user's
program would: a cache hit says so and runs no calibration pass; a miss calibrates (progress bar),
runs the recipe's quality gate, writes the entry atomically and says where. Prints the gate's figures
(min cosine, max |delta|, worst layer) from the report next to the entry. ``--data`` takes a trace
recorded with ``flashrt bench ... --save-trace`` (its observations; the first ``samples`` calibrate,
the next ``holdout`` gate). A gate failure is a CalibrationError (one line, exit 2).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

QUANTIZED = ("int8", "fp8")


def calibrate(
    path: Annotated[str, typer.Argument(help="checkpoint folder, or a hub id in the local Hugging Face "
                                        "cache")],
    recipe: Annotated[str, typer.Option(help="recipe name (calibration/NAME.toml) or TOML path; "
                                             "default: the family's")] = "",
    samples: Annotated[int | None, typer.Option(help="calibration samples (default: the recipe's)")] = None,
    data: Annotated[Path | None, typer.Option(help="recorded observations (`flashrt bench --save-trace`)")]
    = None,
    precision: Annotated[str, typer.Option(help="int8 or fp8")] = "int8",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer file when the checkpoint lacks it "
                                                   "(Pi0/Pi0.5: PaliGemma's tokenizer.model)")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--dir", help="calibration cache folder")] = None,
    embodiment: Annotated[str | None, typer.Option(help="GROOT: the embodiment tag (or its id)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Calibrate a checkpoint's int8 / fp8 scales into the cache (a hit runs no calibration)."""
    import flashrt
    from flashrt.errors import ConfigError
    from flashrt.quant.flow import Calibration

    if precision not in QUANTIZED:
        raise ConfigError(f"--precision must be one of {list(QUANTIZED)}, got {precision!r}")
    observations = _trace_observations(data) if data is not None else None
    start = time.perf_counter()
    from flashrt.runner.policy import cli_options

    options = cli_options(tokenizer, embodiment)
    from flashrt.io.hub import resolve_checkpoint

    policy = flashrt.load_policy(resolve_checkpoint(path), device=device, precision=precision, **options,
                                 calibration=Calibration(recipe=recipe, samples=samples, data=observations,
                                                         cache_dir=cache_dir, progress=not as_json))
    info = dict(policy.frontend.quantization or {})
    info["load_seconds"] = round(time.perf_counter() - start, 3)
    info["gate"] = _gate(Path(info.get("report", "")))
    if as_json:
        typer.echo(json.dumps(info))
        return
    _print(info)


def _trace_observations(path: Path) -> list[Any]:
    from flashrt.bench.trace import FrozenTrace

    return list(FrozenTrace.load(path).inputs)


def _gate(report: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return None
    keys = ("passed", "min_cosine", "max_abs_delta", "max_layer_error", "worst_layer")
    return {k: data.get(k) for k in keys}


def _print(info: dict[str, Any]) -> None:
    if info.get("cache") == "hit":
        typer.echo(f"cache hit: {info['entry']} (no calibration pass; cold start {info['load_seconds']} s)")
    else:
        typer.echo(f"calibrated and stored {info.get('entry')} ({info.get('seconds')} s; "
                   f"load {info['load_seconds']} s)")
    gate = info.get("gate")
    if gate:
        typer.echo(f"gate: min cosine {gate['min_cosine']:.5f}, max |delta| {gate['max_abs_delta']:.4g}, "
                   f"worst layer {gate['worst_layer']} (relative error {gate['max_layer_error']:.3g})")
    typer.echo(f"{info.get('sites')} GEMMs {info.get('kind')} ({info.get('activations')} activations), "
               f"recipe {info.get('recipe')}")
