"""Command-line entry points: `flashrt bench`, `flashrt loop`, `flashrt soak`.

Plain Typer command functions (mounted by `flashrt.cli`: `app.command()(bench)` etc.); imports stay
inside the functions so `flashrt --help` does not load torch. Each command prints tables for people
on stderr, writes a results JSON (and a PNG) under `--out`, and prints one JSON line LAST on stdout.

Exit codes: 0 ok, 1 gated out / leak flagged, 2 configuration error, 3 profile refused on this device,
4 the `--vs` side failed (unavailable, failed to build or run, or gated out; its one-line reason is
printed on stderr; flashrt's own figures are still written).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

EXIT = {"ok": 0, "gated-out": 1, "leak": 1, "error": 2, "refused": 3, "vs-failed": 4}

ProfileOpt = Annotated[str, typer.Option("--profile", "-p", help="profile name (profiles/) or a .toml path")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="output folder [bench/results/<kind>-<name>-...]")]
CheckpointOpt = Annotated[str | None, typer.Option("--checkpoint", help="checkpoint path (when the "
                                                   "benchmark loads one; default: tiny/seeded preset)")]
TokenizerOpt = Annotated[str | None, typer.Option("--tokenizer", help="the policy's text tokenizer when the "
                                                  "checkpoint lacks it (Pi0/Pi0.5/Pi0-FAST: PaliGemma's "
                                                  "tokenizer.model); sets the profile's [model] tokenizer")]


def _out_dir(out: Path | None, kind: str, name: str, profile: str) -> Path:
    """The output folder, created now: an unwritable --out fails before anything runs."""
    from flashrt.errors import ConfigError

    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = out or Path("bench/results") / f"{kind}-{name}-{Path(profile).stem}-{stamp}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {folder}: cannot create this folder ({exc.strerror or exc}); "
                          "choose a writable one") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--out {folder}: this folder is not writable; choose a writable one")
    return folder


def _finish(record: dict[str, Any], out: Path | None, files: dict[str, str] | None = None) -> None:
    """Write the results JSON (when `out`), print the JSON line last, exit with the status code."""
    from flashrt.profile.report import json_line, write_json

    line = record.pop("line", None) or record
    if out is not None:
        record.setdefault("files", {}).update(files or {}, json=str(out / "results.json"))
        write_json(out / "results.json", record)
    if line is not record and out is not None:
        line["results"] = record["files"]["json"]
    typer.echo(json_line(line))
    raise typer.Exit(EXIT.get(record.get("status", "error"), 2))


def _save_then_plot(record: dict[str, Any], folder: Path, plot: bool, png: str, draw: Any,
                    files: dict[str, str] | None = None) -> dict[str, str]:
    """results.json first (a missing or failing matplotlib never loses a run), then ``draw(record,
    path)``'s figure, or ``png_skipped``: one line saying why there is none (also on stderr)."""
    from flashrt.bench.harness import one_line
    from flashrt.profile.report import write_json

    files = dict(files or {})
    record.setdefault("files", {}).update(files, json=str(folder / "results.json"))
    write_json(folder / "results.json", record)
    if not plot:
        return files
    try:
        return files | {"png": str(draw(record, folder / png))}
    except Exception as exc:  # plotting is a convenience: the results are already on disk
        note = one_line(exc)
        typer.echo(f"figure skipped ({note}); results: {folder / 'results.json'}", err=True)
        return files | {"png_skipped": note}


def _failure(kind: str, name: str, profile: str, exc: Exception) -> dict[str, Any]:
    from flashrt.errors import DeviceError

    status = "refused" if isinstance(exc, DeviceError) else "error"
    typer.echo(f"{kind} {name}: {status}: {exc}", err=True)
    reason = f"{type(exc).__name__}: {exc}"
    if kind == "bench":  # the full result schema, empty where nothing ran
        from flashrt.bench.harness import BenchResult

        return BenchResult(name, status, reason, profile={"name": profile}).to_dict()
    return {"schema": f"flashrt.{kind}.result/1", "kind": kind, "benchmark": name, "status": status,
            "profile": {"name": profile}, "reason": reason}


def _list() -> None:
    from flashrt.bench.profiles import list_profiles
    from flashrt.bench.registry import available, discover

    for name, entry in available().items():
        typer.echo(f"benchmark  {name:20} {entry.description}")
    for module, error in discover().items():
        typer.echo(f"(not importable) {module}: {error}")
    for name, path in list_profiles().items():
        typer.echo(f"profile    {name:20} {path}")


def bench(
    name: Annotated[str, typer.Argument(help="registered benchmark (see --list)")] = "runtime-block",
    profile: ProfileOpt = "cpu-tiny",
    vs: Annotated[str | None, typer.Option(help="second implementation: eager, compile, trace, cuda, "
                                           "or a reference package (lerobot, vocos ...)")] = None,
    iters: Annotated[int | None, typer.Option(help="timed calls [profile bench.iters]")] = None,
    warmup: Annotated[int | None, typer.Option(help="warm-up calls [profile bench.warmup]")] = None,
    backend: Annotated[str | None, typer.Option(help="graph backend [profile runtime.backend]")] = None,
    checkpoint: CheckpointOpt = None,
    tokenizer: TokenizerOpt = None,
    snac_noise: Annotated[str | None, typer.Option("--snac-noise", help="bench snac: 'off' (default) drops "
                                                   "the released decoder's noise; 'seeded' decodes with its "
                                                   "noise blocks, drawn reproducibly ([model] noise_mode)")]
    = None,
    trace: Annotated[str | None, typer.Option(help="replay a recorded trace file")] = None,
    save_trace: Annotated[bool, typer.Option(help="save the frozen trace as trace.pt in --out")] = False,
    trace_out: Annotated[Path | None, typer.Option(help="write a Chrome / Perfetto trace JSON "
                                                   "(ui.perfetto.dev): the timed calls' stages on the CPU, "
                                                   "torch.profiler (kernels + stages) on a GPU")] = None,
    out: OutOpt = None,
    plot: Annotated[bool, typer.Option(help="write latency.png")] = True,
    progress: Annotated[bool, typer.Option(help="progress bar on stderr")] = True,
    list_all: Annotated[bool, typer.Option("--list", help="list benchmarks and profiles")] = False,
    sweep: Annotated[str | None, typer.Option(help="length sweep against --vs instead (vocoders): 'auto' "
                                              "or frame counts '50,200,333'")] = None,
    pairs: Annotated[int, typer.Option(help="interleaved timed pairs per sweep length")] = 5,
    precision: Annotated[str | None, typer.Option(help="run this precision instead of the profile's "
                                                  "(fp32, bf16, fp16, int8, fp8)")] = None,
) -> None:
    """Benchmark a registered frontend: quality gate, per-stage latency, cold start, memory, roofline."""
    if list_all:
        return _list()
    if sweep is not None:
        return _sweep(name, profile, _sweep_options(checkpoint, vs, backend, progress), sweep, pairs, out,
                      plot)
    from flashrt.bench.harness import BenchOptions, render, run_benchmark, write_outputs
    from flashrt.bench.profiles import load_profile
    from flashrt.bench.registry import get_benchmark
    from flashrt.errors import FlashRTError

    try:
        get_benchmark(name)
    except FlashRTError as exc:  # a mistyped name: the error line and the JSON line, no output folder
        return _finish(_failure("bench", name, profile, exc), None)
    folder = _out_dir(out, "bench", name, profile)
    try:
        options = BenchOptions(checkpoint, vs, iters, warmup, backend, trace, progress, precision, tokenizer,
                               snac_noise, chrome_trace=trace_out is not None)
        result = run_benchmark(name, load_profile(profile), options)
    except (FlashRTError, ImportError) as exc:
        return _finish(_failure("bench", name, profile, exc), folder)
    write_outputs(result, folder, plot=plot, save_trace=save_trace, trace_out=trace_out)
    render(result)
    figure = result.files.get("png") or f"none ({result.files.get('png_skipped', 'plots off')})"
    typer.echo(f"results: {result.files.get('json')}  samples: {result.files.get('samples', '-')}  "
               f"figure: {figure}", err=True)
    status = result.status
    if status == "ok" and result.vs and result.vs.get("status") != "ok":
        typer.echo(f"bench {name}: --vs {vs} {result.vs['status']}: {result.vs.get('reason')}", err=True)
        status = "vs-failed"
    _finish({"line": result.summary_line(), "status": status}, None)


def _sweep_options(checkpoint: str | None, vs: str | None, backend: str | None, progress: bool) -> Any:
    from flashrt.bench.harness import BenchOptions

    return BenchOptions(checkpoint, vs, None, None, backend, None, progress)


def _sweep(name: str, profile: str, options: Any, lengths: str, pairs: int, out: Path | None,
           plot: bool = True) -> None:
    """`bench NAME --sweep`: flashrt against --vs at every length (`flashrt.bench.sweep`)."""
    from flashrt.bench.profiles import load_profile
    from flashrt.bench.sweep import parse_lengths, plot_sweep, render_sweep, run_sweep
    from flashrt.errors import FlashRTError

    folder = _out_dir(out, "sweep", name, profile)
    try:
        record = run_sweep(name, load_profile(profile), options, parse_lengths(lengths), pairs)
    except (FlashRTError, ImportError) as exc:
        return _finish(_failure("sweep", name, profile, exc), folder)
    render_sweep(record)
    files = _save_then_plot(record, folder, plot, "sweep.png", lambda r, path: plot_sweep(path, r))
    _finish(record, folder, files)


def loop(
    name: Annotated[str, typer.Argument(help="registered benchmark offering policy()")] = "runtime-block",
    profile: ProfileOpt = "cpu-tiny",
    rate: Annotated[float | None, typer.Option(help="control rate in Hz [profile target_rate_hz]")] = None,
    steps: Annotated[int, typer.Option(help="ticks to run")] = 500,
    chunk: Annotated[int, typer.Option(help="chunk size for boundaries (0: from the policy)")] = 0,
    load: Annotated[int, typer.Option(help="background CPU burners")] = 0,
    load_kind: Annotated[str, typer.Option(help="process | thread")] = "process",
    checkpoint: CheckpointOpt = None,
    tokenizer: TokenizerOpt = None,
    out: OutOpt = None,
    plot: Annotated[bool, typer.Option(help="write loop.png")] = True,
    async_mode: Annotated[bool, typer.Option("--async", help="also run through flashrt.AsyncPolicy "
                                             "(real-time chunking) and report both side by side")] = False,
    trace_out: Annotated[Path | None, typer.Option(help="write every tick's step (and its stages) as a "
                                                   "Chrome / Perfetto trace JSON (ui.perfetto.dev)")] = None,
) -> None:
    """Control-loop simulator: step(obs) at a fixed rate; deadline misses, action age, chunk boundaries."""
    from flashrt.bench.harness import with_model
    from flashrt.bench.loop import (
        LoopConfig,
        loop_chrome_events,
        loop_figure,
        loop_tables,
        run_loop_benchmark,
    )
    from flashrt.bench.profiles import load_profile
    from flashrt.errors import FlashRTError

    folder = _out_dir(out, "loop", name, profile)
    try:
        prof = with_model(load_profile(profile), tokenizer=tokenizer)
        rate = prof.bench.target_rate_hz if rate is None else rate
        config = LoopConfig(rate, steps, chunk, load, load_kind, async_mode=async_mode)
        record = run_loop_benchmark(name, prof, config, checkpoint)
    except (FlashRTError, ImportError, ValueError) as exc:
        return _finish(_failure("loop", name, profile, exc), folder)
    loop_tables(record)
    if "loop_async" in record:
        from flashrt.bench.loop_async import side_by_side_tables

        side_by_side_tables(record)
    files = {}
    if trace_out is not None:
        from flashrt.profile.timers import write_chrome_trace

        files["chrome_trace"] = str(write_chrome_trace(trace_out, loop_chrome_events(record)))
    files = _save_then_plot(record, folder, plot, "loop.png", loop_figure, files)
    _finish(record | {"line": _loop_line(record)}, folder, files)


def _loop_line(record: dict[str, Any]) -> dict[str, Any]:
    s = record["loop"]
    return {"schema": record["schema"], "kind": "loop", "benchmark": record["benchmark"], "status": "ok",
            "rate_hz": s["config"].rate_hz, "executed": s["executed"], "missed": s["missed"],
            "miss_rate": s["miss_rate"], "dropped_ticks": s["dropped_ticks"],
            "latency_p50": s["latency"].p50, "latency_p99": s["latency"].p99,
            "action_age_p50": s["action_age"].p50, "action_age_p99": s["action_age"].p99,
            "boundaries": s["boundaries"], **_async_line(record)}


def _async_line(record: dict[str, Any]) -> dict[str, Any]:
    if "loop_async" not in record:
        return {}
    s = record["loop_async"]
    sides = {"sync": record["loop"], "async": s}
    return {"async": {"missed": s["missed"], "dropped_ticks": s["dropped_ticks"],
                      "action_age_p50": s["action_age"].p50, "action_age_p99": s["action_age"].p99,
                      **s["async"]},
            "discontinuity": {name: side["discontinuity"] for name, side in sides.items()}}


def soak(
    name: Annotated[str, typer.Argument(help="registered benchmark")] = "runtime-block",
    profile: ProfileOpt = "cpu-tiny",
    steps: Annotated[int | None, typer.Option(help="steps [profile bench.soak_steps]")] = None,
    checkpoint: CheckpointOpt = None,
    tokenizer: TokenizerOpt = None,
    out: OutOpt = None,
    plot: Annotated[bool, typer.Option(help="write soak.png")] = True,
    progress: Annotated[bool, typer.Option(help="progress bar on stderr")] = True,
) -> None:
    """Soak: K steps, memory growth (RSS slope) and latency drift; flags a leaking frontend."""
    from flashrt.bench.harness import with_model
    from flashrt.bench.profiles import load_profile
    from flashrt.bench.soak import SoakConfig, run_soak_benchmark, soak_figure, soak_tables
    from flashrt.errors import FlashRTError

    folder = _out_dir(out, "soak", name, profile)
    try:
        prof = with_model(load_profile(profile), tokenizer=tokenizer)
        config = SoakConfig(steps=prof.bench.soak_steps if steps is None else steps)
        record = run_soak_benchmark(name, prof, config, checkpoint, progress)
    except (FlashRTError, ImportError, ValueError) as exc:
        return _finish(_failure("soak", name, profile, exc), folder)
    soak_tables(record)
    from flashrt.profile.report import write_json

    raw = {"per_step_ms": record["soak"].pop("per_step_ms"), "worst": record["soak"]["worst"]}
    files = {"samples": str(write_json(folder / "samples.json", raw))}  # null: a failed step
    files = _save_then_plot(record, folder, plot, "soak.png", soak_figure, files)
    s = record["soak"]
    line = {"schema": record["schema"], "kind": "soak", "benchmark": name, "status": record["status"],
            "steps": s["steps"], "failures": s["failures"], "leak": s["leak"],
            "rss_mib_per_1k_steps": s["rss"]["mib_per_1k_steps"], "rss_growth_mib": s["rss"]["growth_mib"],
            "drift_ratio": s["drift"]["ratio"]}
    _finish(record | {"line": line}, folder, files)


def main() -> None:
    """Stand-alone entry (`python -m flashrt.bench.cli`): the three commands under one app."""
    import sys

    from flashrt.cli import run_app

    app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
    for command in (bench, loop, soak):
        app.command()(command)
    sys.exit(run_app(app, prog_name="flashrt-bench"))


if __name__ == "__main__":
    main()
