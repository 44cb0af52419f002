"""`flashrt export PATH --format onnx [--bucket N ...] [--precision P [--recipe R]] -o DIR`: each shape
bucket's step as an ONNX file.

Loads PATH as a user's program would (a policy folder, else a vocoder checkpoint/folder; `--kind`
forces one), captured with the `trace` backend at the given buckets (prompt tokens for a policy,
frames for a vocoder; default: the model's own), then exports each bucket's step with the `onnxrt`
backend's exporter (`flashrt.runtime.onnx_export`: the declared buffers as named inputs/outputs,
checked by onnx.checker) through the export cache, so a later `backend="onnxrt"` load of the same
model is a cache hit. Writes `<DIR>/<name>-<bucket>.onnx` and `<DIR>/manifest.json` (per bucket: the
file, its inputs and outputs with shapes and dtypes, whether it came from the cache).

`--precision` loads the model in that precision first. A policy in ``int8`` is quantized with the
calibration cache's scales (calibrated and gated on a miss, with `--recipe`; a hit runs no calibration)
and its GEMMs are written as QuantizeLinear / DequantizeLinear carrying those scales
(`flashrt.quant.linear.portable`): the files TensorRT (`trtexec --onnx=...`, strongly typed) or
onnxruntime run as int8 without a calibrator of their own. The manifest names the precision and, for a
quantized model, its calibration entry. ``fp8`` likewise, as float8e4m3fn Q/DQ (opset 19).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

FORMATS = ("onnx",)
KINDS = ("auto", "policy", "vocoder")


def _load(path: Path, kind: str, buckets: list[int] | None, options: dict[str, Any]) -> Any:
    import flashrt
    from flashrt.errors import CheckpointError, ConfigError
    from flashrt.runner.policy import detect_family

    why_not_policy = ""
    if kind == "auto":
        try:
            detect_family(path)
            kind = "policy"
        except CheckpointError as exc:
            kind, why_not_policy = "vocoder", str(exc)
    if kind == "policy":
        return flashrt.load_policy(path, backend="trace", buckets=buckets or None, **options)
    policy_only = sorted(set(options) & {"tokenizer", "embodiment", "calibration"})
    if policy_only:
        hint = f" ({why_not_policy})" if why_not_policy else ""
        raise ConfigError(f"{path} is loaded as a vocoder, which takes no {policy_only}{hint}")
    try:
        return flashrt.load_vocoder(path, backend="trace", buckets=tuple(buckets) if buckets else None,
                                    **options)
    except CheckpointError as exc:
        if not why_not_policy:
            raise
        raise CheckpointError(f"{path} is neither a policy ({why_not_policy}) nor a vocoder ({exc})") from exc


def _graph_set(model: Any) -> Any:
    """The bucket GraphSet behind a loaded model: a vocoder's frontend holds it, a policy's family
    frontend wraps the frontend that does."""
    node = model
    for _ in range(3):
        node = getattr(node, "frontend", None)
        graphs = getattr(node, "graphs", None)
        if graphs is not None and hasattr(graphs, "build"):
            return graphs
    return None


def _port(p) -> dict[str, Any]:
    return {"shape": list(p.tensor.shape), "dtype": str(p.tensor.dtype).removeprefix("torch.")}


def export_graphs(path: Path, out: Path, buckets: list[int] | None = None, kind: str = "auto",
                  cache_dir: Path | None = None, **options: Any) -> dict[str, Any]:
    """Export every bucket of the model at `path` into `out`; returns the manifest (also written)."""
    from flashrt.errors import ConfigError
    from flashrt.io.atomic import atomic_write_bytes, atomic_write_text
    from flashrt.runtime.onnxrt import OnnxRuntimeBackend

    if kind not in KINDS:
        raise ConfigError(f"kind {kind!r}; choose one of {list(KINDS)}")
    model = _load(path, kind, buckets, options)
    graphs = _graph_set(model)
    if graphs is None:
        raise ConfigError(f"{path}: this model runs without bucket graphs; nothing to export")
    backend = OnnxRuntimeBackend(cache_dir=cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = path.stem or "model"
    manifest: dict[str, Any] = {"source": str(path), "format": "onnx",
                                "precision": str(options.get("precision", "float32")), "buckets": {}}
    quantization = getattr(model.frontend, "quantization", None)
    if quantization:
        manifest["quantization"] = {k: quantization.get(k) for k in ("kind", "recipe", "cache", "entry",
                                                                     "activations", "sites")}
    for bucket in graphs.buckets:
        plan, data, hit = backend.export(graphs.build(bucket), graphs.buffers)
        file = out / f"{name}-{bucket}.onnx"
        atomic_write_bytes(file, data)
        manifest["buckets"][str(bucket)] = {
            "file": file.name, "bytes": len(data), "cache_hit": hit,
            "inputs": {p.input_name: _port(p) for p in plan.inputs},
            "outputs": {p.name: _port(p) for p in plan.outputs}}
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def export(
    path: Annotated[str, typer.Argument(help="policy folder or vocoder checkpoint/folder, or a hub id in "
                                        "the local Hugging Face cache")],
    out: Annotated[Path, typer.Option("-o", "--out", help="output folder")],
    format: Annotated[str, typer.Option("--format", help="onnx")] = "onnx",
    bucket: Annotated[list[int] | None, typer.Option("--bucket", help="a shape bucket (repeat); "
                                                     "default: the model's")] = None,
    kind: Annotated[str, typer.Option(help="auto, policy or vocoder")] = "auto",
    tokenizer: Annotated[Path | None, typer.Option(help="policy tokenizer (Pi0: tokenizer.model)")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="export cache folder")] = None,
    precision: Annotated[str, typer.Option(help="float32, bfloat16, float16, int8 or fp8 (a policy: "
                                           "Q/DQ with flashrt's calibrated scales)")] = "float32",
    recipe: Annotated[str | None, typer.Option(help="calibration recipe of an int8 policy (name or "
                                               "path; default: the family's)")] = None,
    embodiment: Annotated[str | None, typer.Option(help="GROOT: the embodiment tag (or its id)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the manifest as JSON")] = False,
) -> None:
    """Export each shape bucket's captured step to ONNX (buffers as named inputs and outputs)."""
    from flashrt.errors import ConfigError

    if format not in FORMATS:
        raise ConfigError(f"format {format!r}; choose one of {list(FORMATS)}")
    from flashrt.runner.policy import cli_options

    options = cli_options(tokenizer, embodiment)
    if precision != "float32":
        options["precision"] = precision
    if recipe is not None:
        if precision not in ("int8", "fp8"):
            raise ConfigError(f"--recipe applies to --precision int8 or fp8, not {precision!r}")
        options["calibration"] = {"recipe": recipe, "progress": not as_json}
    elif precision in ("int8", "fp8"):
        options["calibration"] = {"progress": not as_json}
    from flashrt.io.hub import resolve_checkpoint

    manifest = export_graphs(resolve_checkpoint(path), out, bucket, kind, cache_dir, **options)
    if as_json:
        typer.echo(json.dumps(manifest, indent=1))
        return
    for b, entry in manifest["buckets"].items():
        ins, outs = ", ".join(entry["inputs"]), ", ".join(entry["outputs"])
        typer.echo(f"bucket {b}: {out / entry['file']} ({entry['bytes']} bytes, "
                   f"{'cache hit' if entry['cache_hit'] else 'exported'}) inputs [{ins}] outputs [{outs}]")
