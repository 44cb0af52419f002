"""`flashrt export PATH --format onnx [--bucket N] -o DIR` (flashrt/export.py), run in-process as the console
script does: one checked ONNX file per bucket plus manifest.json, graph inputs/outputs named after the
vocoder's own declared buffers, a second export served by the export cache, bad arguments one line; a
Pi0.5 policy in int8 (the policy path: its graphs sit behind the family frontend) with Q/DQ nodes."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import flashrt
from flashrt.cli import main

pytestmark = pytest.mark.timeout(300)
CHECKPOINT = Path(__file__).resolve().parent / "fixtures" / "vocoders" / "hifigan_v1_tiny"


def _export(capsys, out: Path, cache: Path, *extra: str) -> tuple[int, dict]:
    code = main(["export", str(CHECKPOINT), "--format", "onnx", "--bucket", "16", "-o", str(out),
                 "--cache-dir", str(cache), *extra])
    capsys.readouterr()
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else {}
    return code, manifest


@pytest.fixture(scope="module")
def buffer_roles() -> dict[str, str]:
    """The declared buffers of the same checkpoint, loaded independently of the export: name -> role."""
    voc = flashrt.load_vocoder(CHECKPOINT, backend="eager", buckets=(16,))
    return {spec.name: spec.role for spec in voc.frontend.buffers.specs}


def test_export_writes_checked_models_named_after_the_buffers(capsys, tmp_path, one_thread, buffer_roles):
    code, manifest = _export(capsys, tmp_path / "out", tmp_path / "cache")
    assert code == 0
    assert manifest["format"] == "onnx" and "16" in manifest["buckets"]
    for bucket, entry in manifest["buckets"].items():
        path = tmp_path / "out" / entry["file"]
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        assert path.stat().st_size == entry["bytes"]
        inputs = [i.name for i in model.graph.input]
        outputs = [o.name for o in model.graph.output]
        assert inputs == list(entry["inputs"]) and outputs == list(entry["outputs"]), bucket
        # a read buffer is the input <name>; a written one the output <name> and the input <name>.in
        assert {n.removesuffix(".in") for n in inputs} <= set(buffer_roles), inputs
        assert outputs == ["audio"] and buffer_roles["audio"] == "output"
        assert "features" in inputs and "audio.in" in inputs
        dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert dims == entry["inputs"][inputs[0]]["shape"]  # static shapes, as the manifest says
        assert not entry["cache_hit"]


def test_second_export_is_served_by_the_cache(capsys, tmp_path, one_thread):
    _, first = _export(capsys, tmp_path / "a", tmp_path / "cache")
    code, again = _export(capsys, tmp_path / "b", tmp_path / "cache")
    assert code == 0
    assert all(e["cache_hit"] for e in again["buckets"].values())
    for bucket, entry in again["buckets"].items():
        same = first["buckets"][bucket]["file"]
        assert (tmp_path / "b" / entry["file"]).read_bytes() == (tmp_path / "a" / same).read_bytes()


@pytest.mark.parametrize(("extra", "needle"), [(("--kind", "robot"), "kind 'robot'"),
                                               (("--format", "tflite"), "format 'tflite'")])
def test_bad_arguments_are_one_line_errors(capsys, tmp_path, extra, needle):
    argv = ["export", str(CHECKPOINT), "-o", str(tmp_path / "out"), *extra]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert needle in err and err.startswith("flashrt: error: ")
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.fixture
def pi05_dir(tmp_path, monkeypatch):
    import flashrt.quant.cache
    from flashrt.testing.synthetic.pi0 import TINY, SyntheticSpec, write_checkpoint

    monkeypatch.setattr(flashrt.quant.cache, "default_root", lambda: tmp_path / "cal")  # not the user's
    folder = tmp_path / "pi05"
    write_checkpoint(folder, SyntheticSpec("pi05", TINY, ("top", "wrist")))
    return folder


def test_int8_policy_exports_qdq_with_its_calibrated_scales(capsys, tmp_path, one_thread, pi05_dir):
    """The deployment path to TensorRT / onnxruntime int8: flashrt's scales in the file, no calibrator."""
    out = tmp_path / "out"
    code = main(["export", str(pi05_dir), "--precision", "int8", "--bucket", "64", "-o", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--json"])
    capsys.readouterr()
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and manifest["quantization"]["kind"] == "int8"
    q = manifest["quantization"]
    assert q["cache"] == "calibrated" and Path(q["entry"]).is_file()
    model = onnx.load(str(out / manifest["buckets"]["64"]["file"]))
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") >= manifest["quantization"]["sites"] and "DequantizeLinear" in ops
    code = main(["export", str(pi05_dir), "--precision", "int8", "--bucket", "64", "-o",
                 str(tmp_path / "again"), "--cache-dir", str(tmp_path / "cache"), "--json"])
    capsys.readouterr()
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert code == 0 and again["quantization"]["cache"] == "hit" and again["buckets"]["64"]["cache_hit"]


@pytest.mark.parametrize(("extra", "needle"), [(("--recipe", "pi0"), "--recipe applies to --precision int8"),
                                               (("--precision", "int4"), "unknown precision 'int4'")])
def test_quantized_export_refusals_are_one_line_errors(capsys, tmp_path, one_thread, pi05_dir, extra, needle):
    code = main(["export", str(pi05_dir), "--bucket", "64", "-o", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and needle in err
    assert not (tmp_path / "out" / "manifest.json").exists()


GROOT = Path(__file__).resolve().parent / "fixtures" / "groot" / "n17_tiny"


def test_groot_export_takes_the_embodiment(capsys, tmp_path, one_thread):
    argv = ["export", str(GROOT), "-o", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2 and "embodiment None is not in this checkpoint" in capsys.readouterr().err
    assert main([*argv, "--embodiment", "tag_a", "--json"]) == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["buckets"] and manifest["precision"] == "float32"


def test_policy_options_on_a_vocoder_are_one_line_errors(capsys, tmp_path):
    code = main(["export", str(CHECKPOINT), "-o", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "loaded as a vocoder, which takes no ['tokenizer']" in err


def test_cli_options():
    from flashrt.runner.policy import cli_options
    assert cli_options() == {}
    assert cli_options(Path("t.model"), "3") == {"tokenizer": "t.model", "embodiment": 3}
    assert cli_options(embodiment="tag_a") == {"embodiment": "tag_a"}
