"""`flashrt cache ls|verify|rm` through typer's CliRunner (flashrt/quant/cli.py)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from flashrt.quant.cache import CacheKey, CalibrationCache
from flashrt.quant.cli import cache_app

runner = CliRunner()


def _key(model: str, arch: str = "sm89") -> CacheKey:
    return CacheKey.create(data_digest="ab" * 32, config={"width": 8}, shapes={"chunk": 4},
                           recipe={"samples": 2}, precision={"preset": "fp8"}, arch=arch, model=model)


@pytest.fixture
def filled(tmp_path):
    cache = CalibrationCache(tmp_path / "cal")
    paths = [cache.store(_key(m), {"fc": torch.tensor(0.5)}) for m in ("alpha", "beta")]
    return cache, paths


def _run(*args):
    return runner.invoke(cache_app, list(args))


def test_ls_table_and_json(filled):
    cache, paths = filled
    table = _run("ls", "--dir", str(cache.root))
    assert table.exit_code == 0, table.output
    assert "alpha" in table.output and "beta" in table.output and "sm89" in table.output
    rows = json.loads(_run("ls", "--dir", str(cache.root), "--json").output)
    assert sorted(r["name"] for r in rows) == sorted(p.name for p in paths)
    assert all(r["scales"] == 1 and r["problem"] == "" for r in rows)


def test_ls_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _run("ls", "--dir", str(tmp_path / "empty"))
    assert result.exit_code == 0 and "no calibration entries" in result.output


@pytest.mark.parametrize("command", ["ls", "verify", "rm"])
@pytest.mark.parametrize("where", ["missing folder", "a file"])
def test_a_dir_that_is_missing_or_a_file_is_one_line_and_non_zero(tmp_path, command, where):
    target = tmp_path / "none"
    if where == "a file":
        target.write_bytes(b"not a folder")
    extra = ["--all"] if command == "rm" else []
    result = runner.invoke(cache_app, [command, "--dir", str(target), *extra])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0]
    assert ("is not a folder" if where == "a file" else "does not exist") in lines[0]
    if where == "a file":
        assert target.read_bytes() == b"not a folder"


def test_export_dir_missing_is_one_line_and_non_zero(filled, tmp_path):
    cache, _ = filled
    result = _run("ls", "--dir", str(cache.root), "--export-dir", str(tmp_path / "none"))
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def _checkpoint(folder):
    """A model folder's own safetensors files, one with metadata of its own (not the cache's)."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_file({"w": torch.ones(2)}, str(folder / "adapter.safetensors"))
    (folder / ".tmp-notes").write_text("a user's file, not a flashrt temp file")
    names = ("model.safetensors", "adapter.safetensors", ".tmp-notes")
    return {name: (folder / name).read_bytes() for name in names}


def test_rm_never_touches_files_without_the_cache_metadata(filled):
    cache, paths = filled
    before = _checkpoint(cache.root)
    for name in ("model", "model.safetensors", "adapter"):
        result = _run("rm", name, "--dir", str(cache.root))
        assert result.exit_code == 1 and "no entry matches" in result.output
    everything = _run("rm", "--all", "--dir", str(cache.root))
    assert everything.exit_code == 0
    removed = sorted(line.split()[-1] for line in everything.output.splitlines())
    assert removed == sorted(p.name for p in paths)
    assert {p.name: p.read_bytes() for p in cache.root.iterdir()} == before


def test_rm_all_in_a_checkpoint_folder_keeps_the_checkpoint(tmp_path):
    before = _checkpoint(tmp_path)
    result = _run("rm", "--all", "--dir", str(tmp_path))
    assert result.exit_code == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_verify_good_then_bad(filled):
    cache, paths = filled
    ok = _run("verify", "--dir", str(cache.root))
    assert ok.exit_code == 0 and "2 entries, 0 bad" in ok.output
    data = bytearray(paths[0].read_bytes())
    data[-1] ^= 0x40
    paths[0].write_bytes(bytes(data))
    bad = _run("verify", "--dir", str(cache.root))
    assert bad.exit_code == 1
    assert f"BAD  {paths[0].name}" in bad.output and "scale tensors do not match" in bad.output
    assert "2 entries, 1 bad" in bad.output


def test_rm_by_name_missing_and_all(filled):
    cache, paths = filled
    removed = _run("rm", paths[0].stem, "--dir", str(cache.root))
    assert removed.exit_code == 0 and f"removed {paths[0].name}" in removed.output
    assert not paths[0].exists() and paths[1].exists()
    missing = _run("rm", "gamma", "--dir", str(cache.root))
    assert missing.exit_code == 1 and "no entry matches 'gamma'" in missing.output
    assert _run("rm", "--dir", str(cache.root)).exit_code == 2
    everything = _run("rm", "--all", "--dir", str(cache.root))
    assert everything.exit_code == 0 and cache.files() == []


def test_rm_ambiguous_prefix(tmp_path):
    cache = CalibrationCache(tmp_path)
    for arch in ("sm89", "sm90"):
        cache.store(_key("same", arch), {"fc": torch.tensor(1.0)})
    result = _run("rm", "same", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "matches 2 entries" in result.output
    assert len(cache.files()) == 2


def _export_entry(folder, model: str = "graph") -> str:
    from flashrt.runtime.export_cache import ExportCache, ExportKey

    key = ExportKey(weights="cd" * 32, program="ef" * 32, shapes="{}", precision="torch.float32",
                    exporter="torch x", runtime="onnxruntime y", arch="cpu-x86_64", scheme=1, model=model)
    return ExportCache(folder).store(key, b"onnx model bytes").name


def test_ls_lists_export_entries_beside_calibration_entries(filled, tmp_path):
    cache, paths = filled
    good = _export_entry(tmp_path / "onnx")  # default: the folder `onnx` beside the calibration one
    bad = tmp_path / "onnx" / _export_entry(tmp_path / "onnx", "edited")
    bad.write_bytes(bad.read_bytes()[:-1] + b"X")
    rows = json.loads(_run("ls", "--dir", str(cache.root), "--json").output)
    by_kind = {k: sorted(r["name"] for r in rows if r["kind"] == k) for k in ("calibration", "onnx")}
    assert by_kind == {"calibration": sorted(p.name for p in paths), "onnx": sorted([good, bad.name])}
    onnx_rows = {r["name"]: r for r in rows if r["kind"] == "onnx"}
    assert onnx_rows[good]["problem"] == "" and onnx_rows[good]["runtime"] == "onnxruntime y"
    assert "digest" in onnx_rows[bad.name]["problem"]    # tampered bytes are reported, not trusted
    table = _run("ls", "--dir", str(cache.root))
    assert table.exit_code == 0
    assert "onnx export cache" in table.output and "calibration cache" in table.output
    assert "alpha" in table.output and "graph-" in table.output


def test_ls_export_dir_option(filled, tmp_path):
    cache, _ = filled
    name = _export_entry(tmp_path / "elsewhere")
    rows = json.loads(_run("ls", "--dir", str(cache.root), "--export-dir", str(tmp_path / "elsewhere"),
                           "--json").output)
    assert [r["name"] for r in rows if r["kind"] == "onnx"] == [name]
