"""`flashrt cache ...`: list, verify and remove calibration cache entries (`ls` also lists ONNX exports).

`cache_app` is a Typer sub-application; the main `flashrt` command mounts it as `cache`. Every command
takes `--dir` to point at another cache folder (default: `flashrt.quant.cache.default_root()`).
Exit codes: 0 fine, 1 something bad found (verify) or nothing matched (rm), 2 usage error (a ``--dir``
that is a file or does not exist included: one line on stderr). `rm` touches only files that carry the
cache's metadata: pointed at a checkpoint folder it never deletes its ``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flashrt.quant.cache import CalibrationCache, EntryInfo

cache_app = typer.Typer(help="Inspect and clean the calibration cache.", no_args_is_help=True)

DirOption = Annotated[Path | None, typer.Option("--dir", help="Cache folder (default: the user cache dir).")]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON list instead of a table.")]
NamesArg = Annotated[list[str] | None, typer.Argument(help="Entry names, stems or unique prefixes.")]
AllOption = Annotated[bool, typer.Option("--all", help="Remove every entry and leftover temp file.")]


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


_TABLE_COLUMNS = ("entry", "arch", "scales", "created", "status")  # --json has every field


def _entry_row(e: EntryInfo) -> dict:
    key = e.key or {}
    return {"name": e.path.name, "model": key.get("model", ""), "arch": key.get("arch", ""),
            "scheme": key.get("scheme", ""), "data_digest": str(key.get("data_digest", ""))[:16],
            "scales": e.n_scales, "bytes": e.size, "created": e.created, "problem": e.problem}


def _table_row(r: dict) -> tuple[str, ...]:
    created = r["created"][:16].replace("T", " ")
    return Path(r["name"]).stem, str(r["arch"]), str(r["scales"]), created, r["problem"] or "ok"


ExportDirOption = Annotated[Path | None, typer.Option(
    "--export-dir", help="ONNX export cache folder (default: the folder `onnx` beside the calibration one).")]


def _export_rows(folder: Path) -> list[dict]:
    """The export cache's entries (`flashrt.runtime.export_cache`), as `ls` rows of kind "onnx" or
    "tensorrt" (engines)."""
    from flashrt.runtime.export_cache import ExportCache
    rows = []
    for e in ExportCache(folder).entries():
        key = e.key or {}
        rows.append({"kind": e.kind, "name": e.path.name, "model": key.get("model", ""),
                     "arch": key.get("arch", ""), "runtime": key.get("runtime", ""),
                     "weights": str(key.get("weights", ""))[:16], "bytes": e.size, "created": e.created,
                     "problem": e.problem})
    return rows


def _print_exports(rows: list[dict], folder: Path) -> None:
    if not rows:
        typer.echo(f"no onnx export entries in {folder}")
        return
    table = Table(title=f"onnx export cache: {folder}")
    for col in ("entry", "arch", "runtime", "bytes", "created", "status"):
        table.add_column(col, no_wrap=col != "status", overflow="fold")
    for r in rows:
        table.add_row(Path(r["name"]).stem, r["arch"], r["runtime"], str(r["bytes"]),
                      r["created"][:16].replace("T", " "), r["problem"] or "ok")
    _console().print(table)


def _folder(path: Path | None, what: str) -> Path | None:
    """``path`` if it is usable as a cache folder: one line on stderr and exit 2 for a file, or for a
    folder that was named and does not exist (the default folder not existing yet is an empty cache)."""
    if path is not None and not path.is_dir():
        typer.echo(f"{what} {path} {'is not a folder' if path.exists() else 'does not exist'}", err=True)
        raise typer.Exit(2)
    return path


def _cache(dir: Path | None) -> CalibrationCache:
    cache = CalibrationCache(_folder(dir, "cache folder"))
    if dir is None and cache.root.exists():
        _folder(cache.root, "cache folder")
    return cache


@cache_app.command("ls")
def ls_cmd(dir: DirOption = None, as_json: JsonOption = False, export_dir: ExportDirOption = None):
    """List the entries of both caches, calibration and ONNX export (header facts: `verify` checks the
    calibration entries' contents; export entries are checked as they are listed)."""
    cache = _cache(dir)
    _folder(export_dir, "export cache folder")
    exports_root = export_dir or cache.root.parent / "onnx"
    rows = [{"kind": "calibration", **_entry_row(e)} for e in cache.entries()]
    exports = _export_rows(exports_root)
    if as_json:
        typer.echo(json.dumps(rows + exports, indent=1))
        return
    _print_exports(exports, exports_root)
    if not rows:
        typer.echo(f"no calibration entries in {cache.root}")
        return
    table = Table(title=f"calibration cache: {cache.root}")
    for col in _TABLE_COLUMNS:
        table.add_column(col, no_wrap=col != "status", overflow="fold")
    for r in rows:
        table.add_row(*_table_row(r))
    _console().print(table)


@cache_app.command("verify")
def verify_cmd(dir: DirOption = None):
    """Check every entry: readable, untampered scales, stored under its own key. Exit 1 if any is bad."""
    cache = _cache(dir)
    results = cache.verify()
    for path, ok, reason in results:
        typer.echo(f"{'ok ' if ok else 'BAD'}  {path.name}" + ("" if ok else f"  {reason}"))
    bad = sum(1 for _, ok, _ in results if not ok)
    typer.echo(f"{len(results)} entries, {bad} bad ({cache.root})")
    if bad:
        typer.echo("bad entries are never used (treated as misses); `flashrt cache rm NAME` removes one")
        raise typer.Exit(1)


@cache_app.command("rm")
def rm_cmd(names: NamesArg = None, all: AllOption = False, dir: DirOption = None):
    """Remove entries by name (or all of them): only files that carry the cache's metadata, never another
    ``*.safetensors`` in the folder."""
    cache = _cache(dir)
    if not names and not all:
        typer.echo("name the entries to remove, or pass --all", err=True)
        raise typer.Exit(2)
    removed, missing = _remove(cache, names or [], all)
    for p in removed:
        typer.echo(f"removed {p.name}")
    for name in missing:
        typer.echo(f"no entry matches {name!r} in {cache.root}", err=True)
    if missing:
        raise typer.Exit(1)


def _remove(cache: CalibrationCache, names: list[str], all: bool) -> tuple[list[Path], list[str]]:
    if all:
        return cache.remove(all=True), []
    removed, missing = [], []
    for name in names:
        try:
            found = cache.remove(name)
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        removed += found
        missing += [] if found else [name]
    return removed, missing
