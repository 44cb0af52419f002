import pytest

from flashrt.bench.roofline import DEVICE_PEAKS, cpu_probe, detect_model, device_peak, roofline


def test_table_covers_the_published_devices():
    assert {"h100", "h200", "rtx4090", "rtx5090", "orin", "thor"} <= set(DEVICE_PEAKS)
    for peak in DEVICE_PEAKS.values():
        assert peak.bandwidth_gbs > 0 and peak.tflops.get("bf16", 0) > 0 and peak.source
    assert DEVICE_PEAKS["h200"].peak_tflops("fp16") == DEVICE_PEAKS["h200"].tflops["bf16"]
    assert DEVICE_PEAKS["orin"].peak_tflops("fp8") is None


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA Thor", "thor"),
                                       ("Orin (nvgpu)", "orin"), ("Tesla T4", "unknown")])
def test_detect_model(name, key):
    assert detect_model(name) == key


def test_roofline_math():
    peak = {"name": "x", "tflops": 100.0, "bandwidth_gbs": 1000.0, "source": "test"}
    r = roofline(flops=2e12, nbytes=1e9, seconds=0.1, peak=peak)  # 20 TFLOP/s, 10 GB/s
    assert r["achieved_tflops"] == pytest.approx(20.0) and r["compute_fraction"] == pytest.approx(0.2)
    assert r["achieved_gbs"] == pytest.approx(10.0) and r["bandwidth_fraction"] == pytest.approx(0.01)
    assert r["intensity_flop_per_byte"] == pytest.approx(2000.0) and r["ridge_flop_per_byte"] == 100.0
    assert r["bound"] == "compute"
    assert roofline(1e6, 1e9, 0.1, peak)["bound"] == "memory"
    unknown = roofline(1.0, 1.0, 0.1, {"name": "?", "tflops": None, "bandwidth_gbs": None, "source": ""})
    assert unknown["compute_fraction"] is None and unknown["bound"] is None


def test_cpu_probe_measures_and_caches():
    first = cpu_probe()
    assert first["fp32_gflops"] > 0 and first["memcpy_gbs"] > 0
    assert cpu_probe() == first
    assert device_peak("cpu", "fp32")["tflops"] == pytest.approx(first["fp32_gflops"] / 1e3)
