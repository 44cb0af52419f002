"""Calibration collection, reduction and recipes on a tiny MLP (flashrt/quant/calibrate.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from flashrt.errors import CalibrationError, ConfigError
from flashrt.quant.calibrate import (
    Recipe,
    calibrate,
    collect_amax,
    load_recipe,
    recipe_from_dict,
    reduce_amax,
    samples_digest,
)
from flashrt.quant.ops import fake_quant_linear
from flashrt.quant.precision import PrecisionSpec
from flashrt.resources import list_data


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Looped(nn.Module):
    """One expert applied `steps` times per sample (like flow-matching denoise steps)."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.expert = nn.Linear(4, 4, bias=False)
        nn.init.eye_(self.expert.weight)
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = 2 * self.expert(x)
        return x


def _samples(n: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 8, generator=g) * (i + 1) for i in range(n)]


def test_collect_amax_records_each_gemm_input_per_sample():
    model = TinyMLP().eval()
    samples = _samples()
    got = collect_amax(model, samples)
    assert set(got) == {"fc1", "fc2"}
    with torch.no_grad():
        fc1 = [x.abs().max().item() for x in samples]
        fc2 = [torch.relu(model.fc1(x)).abs().max().item() for x in samples]
    assert got["fc1"].tolist() == pytest.approx(fc1, rel=0, abs=0)
    assert got["fc2"].tolist() == pytest.approx(fc2, rel=1e-6)
    assert not model.fc1._forward_pre_hooks and not model.fc2._forward_pre_hooks


def test_repeated_calls_in_one_sample_keep_the_max():
    model = Looped(steps=3)
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0]])
    got = collect_amax(model, [x, x / 4])
    assert got["expert"].tolist() == [4.0, 1.0]  # inputs 1, 2, 4 (then /4): max over the steps


def test_hooks_are_removed_when_the_model_raises():
    model = TinyMLP()

    def boom(m, sample):
        m(sample)
        raise RuntimeError("sample broke")

    with pytest.raises(RuntimeError, match="sample broke"):
        collect_amax(model, _samples(2), run=boom)
    assert not model.fc1._forward_pre_hooks


def test_unused_module_is_omitted_with_a_warning(caplog):
    model = TinyMLP()
    model.spare = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="flashrt.quant.calibrate"):
        got = collect_amax(model.eval(), _samples(2))
    assert "spare" not in got
    assert any("spare" in r.getMessage() for r in caplog.records)


def test_non_finite_inputs_and_models_without_gemms_are_refused():
    bad = _samples(2)
    bad[1][0, 0] = float("nan")
    with pytest.raises(CalibrationError, match=r"non-finite GEMM inputs .*fc1"):
        collect_amax(TinyMLP().eval(), bad)
    with pytest.raises(CalibrationError, match="no"):
        collect_amax(nn.ReLU(), _samples(1))


def test_dict_and_tuple_samples():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x, y):
            return self.a(x) + self.a(y)

    x, y = torch.ones(1, 2), torch.full((1, 2), -3.0)
    assert collect_amax(Two(), [(x, y)])["a"].tolist() == [3.0]
    assert collect_amax(Two(), [{"x": x, "y": y * 2}])["a"].tolist() == [6.0]


@pytest.mark.parametrize("method, q", [("max", None), ("mean", None), ("percentile", 99.9),
                                       ("percentile", 50.0), ("percentile", 90.0)])
def test_reduce_amax_matches_numpy(method, q):
    a = torch.tensor([3.0, 1.0, 7.0, 2.0, 5.0, 4.0])
    ref = {"max": np.max, "mean": np.mean}.get(method) or (lambda v: np.percentile(v, q))
    assert reduce_amax(a, method, q or 99.9).item() == pytest.approx(float(ref(a.numpy())), rel=1e-6)


def test_reduce_amax_refusals():
    with pytest.raises(ConfigError, match="unknown calibration method"):
        reduce_amax(torch.ones(3), "median")
    with pytest.raises(CalibrationError):
        reduce_amax(torch.ones(0))


def test_calibrate_returns_percentile_scales():
    model = TinyMLP().eval()
    samples = _samples(6)
    recipe = Recipe(method="percentile", percentile=90.0, samples=5)
    scales = calibrate(model, iter(samples), recipe, dtype="fp8_e4m3")
    per_sample = [x.abs().max().item() for x in samples[:5]]  # the first 5: recipe.samples
    assert scales["fc1"].item() == pytest.approx(np.percentile(per_sample, 90.0) / 448, rel=1e-6)
    assert scales["fc1"].shape == () and scales["fc1"].dtype is torch.float32
    int8 = calibrate(model, samples, Recipe(method="max", samples=6), dtype="int8")
    assert int8["fc1"].item() == pytest.approx(max(x.abs().max().item() for x in samples) / 127, rel=1e-6)


def test_calibrate_needs_the_recipe_sample_count():
    with pytest.raises(CalibrationError, match="needs 8 samples, got 3"):
        calibrate(TinyMLP().eval(), _samples(3), Recipe(samples=8))


def test_calibrated_scales_drive_fake_quant_to_small_error():
    model = TinyMLP().eval()
    samples = _samples(8)
    scales = calibrate(model, samples, Recipe(samples=8))
    spec = PrecisionSpec.from_dict({"preset": "fp8", "compute": "fp32"})
    x = samples[3]
    y = fake_quant_linear(x, model.fc1.weight, spec, {"input": scales["fc1"]}, bias=model.fc1.bias)
    ref = model.fc1(x).detach()
    assert ((y - ref).norm() / ref.norm()).item() < 0.06


def test_samples_digest_tracks_the_data():
    s = _samples(3)
    assert samples_digest(s) == samples_digest([t.clone() for t in s])
    changed = [t.clone() for t in s]
    changed[2][0, 0] += 1e-3
    assert samples_digest(changed) != samples_digest(s)
    assert samples_digest([{"a": s[0], "n": 3}]) != samples_digest([{"a": s[0], "n": 4}])


# ---------------------------------------------------------------------------------------------- recipes


def test_shipped_default_recipe():
    assert "default-amax" in list_data("calibration")
    r = load_recipe("default-amax")
    got = (r.name, r.method, r.percentile, r.samples, r.seed, r.data)
    assert got == ("default-amax", "percentile", 99.9, 8, 0, "synthetic")
    assert r.key_fields("abc")["data_digest"] == "abc"


def test_recipe_file_by_path(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('method = "max"\nsamples = 2\ndata = "file:frames.safetensors"\n')
    r = load_recipe(p)
    assert (r.name, r.method, r.samples, r.data) == ("mine", "max", 2, "file:frames.safetensors")
    assert r.data_file(tmp_path) == tmp_path / "frames.safetensors"
    assert r.data_file().parent == list_data("calibration")["default-amax"].parent
    assert Recipe(data="file:/abs/x.safetensors").data_file(tmp_path).as_posix() == "/abs/x.safetensors"
    assert Recipe().data_file() is None


def test_unknown_recipe_key_is_refused(tmp_path):
    p = tmp_path / "typo.toml"
    p.write_text('method = "max"\nsampels = 4\n')
    with pytest.raises(ConfigError, match=r"unknown recipe keys \['sampels'\]"):
        load_recipe(p)


@pytest.mark.parametrize("data, message", [
    ({"samples": "8"}, "samples must be int"),
    ({"samples": True}, "samples must be int"),
    ({"samples": 0}, "samples must be >= 1"),
    ({"percentile": 0}, r"percentile must be in \(0, 100\]"),
    ({"percentile": 100.5}, "percentile must be in"),
    ({"method": "median"}, "unknown method"),
    ({"data": "http://example.com/x"}, "data must be"),
    ({"seed": 1.5}, "seed must be int"),
])
def test_bad_recipe_values(data, message):
    with pytest.raises(ConfigError, match=message):
        recipe_from_dict(data)


def test_unreadable_or_missing_recipe(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("method = \n")
    with pytest.raises(ConfigError, match="calibration recipe .*broken.toml is not valid TOML"):
        load_recipe(p)
    with pytest.raises(ConfigError, match="no calibration recipe 'nope'"):
        load_recipe("nope")
    with pytest.raises(ConfigError, match="calibration recipe .*absent.toml not found"):
        load_recipe(tmp_path / "absent.toml")
