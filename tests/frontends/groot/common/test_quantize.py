"""GR00T N1.7 / N1.6 / N1.5 in int8 and fp8: the calibration gate vs float on held-out observations,
every quantized GEMM running as one, the recipe's sites, the cache hit on a second load, and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.groot import make_policy

import flashrt
from flashrt.errors import ConfigError
from flashrt.frontends.groot.common.quantize import synthetic_observations
from flashrt.quant import flow, linear

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
VARIANTS = {"n17": (FIX / "n17_tiny", {"embodiment": "tag_a"}),
            "n16": (FIX / "n16_tiny", {"embodiment": "tag_a"})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread):
    return {**VARIANTS, "n15": (make_policy(tmp_path_factory.mktemp("n15")), {})}


def _cosine(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize(("variant", "kind"), [("n17", "int8"), ("n16", "int8"), ("n15", "int8"),
                                               ("n17", "fp8")])
def test_quantized_groot_within_the_gate_of_float(folders, tmp_path, variant, kind):
    path, opts = folders[variant]
    ref = flashrt.load_policy(path, **opts)
    cal = {"cache_dir": tmp_path, "progress": False}
    q = flashrt.load_policy(path, precision=kind, calibration=cal, **opts)
    info = q.frontend.quantization
    assert info["cache"] == "calibrated" and info["kind"] == kind and info["recipe"] == "groot"
    assert info["sites"] > 0 and Path(info["report"]).is_file()
    quantized = [n for n, m in q.frontend.model.named_modules()
                 if isinstance(getattr(m, "weight", None), linear.QuantWeight)]
    assert len(quantized) == info["sites"]
    assert not any(n.endswith(("norm1_linear", "proj_out_1", "time_1", "patch_embedding")) for n in quantized)
    linear.FALLBACKS.clear()
    for obs in synthetic_observations(q.frontend, 2, 1234):  # not among the calibration samples
        noise = obs.pop("noise")
        a, b = q.infer(obs, noise=noise)["actions"], ref.infer(obs, noise=noise)["actions"]
        assert _cosine(a, b) >= 0.995 and not np.array_equal(a, b)
    assert not linear.FALLBACKS  # every quantized GEMM ran as one, none through a dequantized weight


def test_second_load_hits_the_cache_and_another_embodiment_misses(folders, tmp_path):
    path, _ = folders["n17"]
    opts = {"cache_dir": tmp_path, "progress": False}
    flashrt.load_policy(path, precision="int8", calibration=opts, embodiment="tag_a")
    runs, hits = flow.COUNTERS["calibrations"], flow.COUNTERS["hits"]
    again = flashrt.load_policy(path, precision="int8", calibration=opts, embodiment="tag_a")
    assert again.frontend.quantization["cache"] == "hit"
    assert flow.COUNTERS["calibrations"] == runs and flow.COUNTERS["hits"] == hits + 1
    other = flashrt.load_policy(path, precision="int8", calibration=opts, embodiment="tag_b")
    assert other.frontend.quantization["cache"] == "calibrated"


def test_refusals(folders):
    path, opts = folders["n17"]
    with pytest.raises(ConfigError, match="calibration= applies to precision 'int8' or 'fp8'"):
        flashrt.load_policy(path, calibration="groot", **opts)
    with pytest.raises(ConfigError, match="unknown precision 'int4'"):
        flashrt.load_policy(path, precision="int4", **opts)


def test_recorded_samples_calibrate(folders, tmp_path):
    """``calibration={"data": ...}``: bench-trace inputs ({"obs", "noise"}) instead of synthetic ones."""
    path, opts = folders["n16"]
    probe = flashrt.load_policy(path, **opts)
    data = [{"obs": {k: v for k, v in o.items() if k != "noise"}, "noise": o["noise"]}
            for o in synthetic_observations(probe.frontend, 10, 7)]
    q = flashrt.load_policy(path, precision="int8", **opts,
                            calibration={"data": data, "cache_dir": tmp_path, "progress": False})
    assert q.frontend.quantization["cache"] == "calibrated"


@pytest.mark.slow
def test_int8_on_onnxrt_within_the_gate_and_close_to_eager(folders, tmp_path, monkeypatch):
    """GR00T's int8 step exported with Q/DQ at the calibrated scales (vision, LM, every DiT step) and run
    by onnxruntime: within the gate of fp32, and closer to eager int8 than int8 is to fp32 (rounding ties
    may move a value by one step under another runtime's float rounding)."""
    import dataclasses
    import functools

    from flashrt.runtime import graphs, onnxrt
    entry = graphs._REGISTRY["onnxrt"]
    factory = functools.partial(onnxrt.OnnxRuntimeBackend, cache_dir=tmp_path / "onnx", threads=1)
    monkeypatch.setitem(graphs._REGISTRY, "onnxrt", dataclasses.replace(entry, factory=factory))
    path, opts = folders["n17"]
    one = {**opts, "buckets": (88,)}
    cal = {"cache_dir": tmp_path / "cal", "progress": False}
    eager = flashrt.load_policy(path, precision="int8", calibration=cal, **one)
    ort = flashrt.load_policy(path, precision="int8", calibration=cal, backend="onnxrt", **one)
    ref = flashrt.load_policy(path, **one)
    assert ort.frontend.quantization["cache"] == "hit"
    for obs in synthetic_observations(eager.frontend, 2, 5):
        noise = obs.pop("noise")
        a, b = ort.infer(obs, noise=noise)["actions"], eager.infer(obs, noise=noise)["actions"]
        f = ref.infer(obs, noise=noise)["actions"]
        assert _cosine(a, f) >= 0.995
        assert np.abs(a - b).max() < 0.75 * np.abs(f - b).max()


def test_the_calibration_key_changes_when_only_the_embodiment_does(folders, monkeypatch):
    """The key fields GROOT gives the flow, for two loads that differ only in the embodiment: the keys
    differ (everything else -- samples, recipe, weights -- held equal), and are equal for the same one."""
    from flashrt.frontends.groot.common import quantize as groot_quantize
    from flashrt.quant.cache import CacheKey

    path, _ = folders["n17"]
    seen = []
    capture = lambda *args, key_fields, **kwargs: seen.append(key_fields)  # noqa: E731
    monkeypatch.setattr(groot_quantize, "quantize_family", capture)
    for tag in ("tag_a", "tag_b", "tag_a"):
        fe = flashrt.load_policy(path, embodiment=tag).frontend
        groot_quantize.quantize(fe, "int8", None, path, weights_digest="w")
    keys = [CacheKey.create(data_digest="d", recipe={"samples": 1}, precision={"kind": "int8"}, model="groot",
                            **fields) for fields in seen]
    assert keys[0] != keys[1] and keys[0] == keys[2]
