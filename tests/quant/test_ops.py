"""Reference quant ops: error bounds, saturation, rounding, per-channel scales (flashrt/quant/ops.py)."""

from __future__ import annotations

import math

import pytest
import torch

from flashrt.errors import CalibrationError
from flashrt.quant.ops import (
    amax,
    amax_per_channel,
    amax_per_tensor,
    compute_scale,
    dequantize,
    fake_quant,
    fake_quant_linear,
    quantize,
    quantize_weight,
)
from flashrt.quant.precision import PrecisionSpec, TensorSpec

SLACK = 1 + 1e-6  # one fp32 rounding in x / scale and q * scale


def _log_uniform(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(n).uniform_(math.log(lo), math.log(hi), generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3
    scale = compute_scale(amax_per_tensor(x), "int8")
    err = (fake_quant(x, scale, "int8") - x).abs()
    assert err.max() <= scale / 2 * SLACK
    assert err.max() > scale / 2 * 0.9  # the bound is tight: this really is a 255-level grid


def test_fp8_round_trip_error_follows_three_mantissa_bits():
    x = _log_uniform(20000, 1e-6, 50.0)
    scale = compute_scale(amax_per_tensor(x), "fp8_e4m3")
    err = (fake_quant(x, scale, "fp8_e4m3") - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool((err <= bound * SLACK).all())
    normal = x.abs() / scale >= 2.0**-6
    assert (err[normal] / x.abs()[normal]).max() > 2.0**-5  # coarser than bf16 (8 bits): really e4m3


def test_fp8_values_are_exactly_representable_after_quantize():
    x = torch.randn(512)
    q = quantize(x, compute_scale(amax_per_tensor(x), "fp8_e4m3"), "fp8_e4m3")
    assert q.dtype is torch.float8_e4m3fn
    assert torch.equal(q.float().to(torch.float8_e4m3fn).float(), q.float())


def test_rounding_is_nearest_even():
    one = torch.tensor(1.0)
    fp8 = quantize(torch.tensor([1.0625, 1.0625 + 1e-4, 1.1875, -1.0625]), one, "fp8_e4m3").float()
    assert fp8.tolist() == [1.0, 1.125, 1.25, -1.0]
    i8 = quantize(torch.tensor([2.5, 3.5, -2.5, 0.49]), one, "int8")
    assert i8.tolist() == [2, 4, -2, 0]


@pytest.mark.parametrize("dtype, qmax", [("fp8_e4m3", 448.0), ("int8", 127.0)])
def test_saturation(dtype, qmax):
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), 3.0])
    q = quantize(x, torch.tensor(0.5), dtype)
    back = dequantize(q, torch.tensor(0.5))
    assert back.tolist() == [qmax * 0.5, -qmax * 0.5, qmax * 0.5, -qmax * 0.5, 3.0]
    assert bool(torch.isfinite(back).all())


def test_compute_scale():
    assert compute_scale(448.0, "fp8_e4m3").item() == 1.0
    assert compute_scale(torch.tensor([127.0, 0.0, 254.0]), "int8").tolist() == [1.0, 1.0, 2.0]
    assert compute_scale(1.0, "fp8").dtype is torch.float32
    with pytest.raises(CalibrationError, match="finite"):
        compute_scale(float("inf"), "fp8_e4m3")
    with pytest.raises(CalibrationError):
        compute_scale(torch.tensor([1.0, float("nan")]), "int8")
    with pytest.raises(CalibrationError):
        compute_scale(-1.0, "int8")
    with pytest.raises(ValueError, match="not a quantized dtype"):
        compute_scale(1.0, "bf16")


def test_amax_reductions():
    w = torch.tensor([[1.0, -5.0, 2.0], [0.5, 0.25, -0.125]])
    assert amax_per_tensor(w).item() == 5.0
    assert amax_per_channel(w).tolist() == [5.0, 0.5]
    assert amax_per_channel(w, axis=1).tolist() == [1.0, 5.0, 2.0]
    assert amax(w, "per_channel").tolist() == [5.0, 0.5]
    x = torch.randn(3, 4, 5)
    manual = torch.tensor([x[:, i].abs().max().item() for i in range(4)])
    assert torch.equal(amax_per_channel(x, axis=1), manual)
    with pytest.raises(ValueError, match="granularity"):
        amax(w, "per_block")


def test_per_channel_scale_must_match_the_axis():
    with pytest.raises(ValueError, match="does not match axis 0"):
        quantize(torch.randn(4, 3), torch.ones(3), "int8")


def _skewed_weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-4, 1, 32).unsqueeze(1)  # rows differ by 10^5 in magnitude
    return torch.randn(32, 64, generator=g) * row_scale


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_per_channel_beats_per_tensor_on_skewed_weights(dtype):
    w = _skewed_weight()
    spec_c = TensorSpec(dtype, "per_channel", "dynamic")
    spec_t = TensorSpec(dtype, "per_tensor", "dynamic")
    errs = {}
    for name, spec in (("channel", spec_c), ("tensor", spec_t)):
        q, s = quantize_weight(w, spec)
        rel = (dequantize(q, s) - w).norm(dim=1) / w.norm(dim=1)  # relative error per output row
        errs[name] = rel.max().item()
    assert errs["channel"] < 0.05
    assert errs["tensor"] > 10 * errs["channel"]


def test_quantize_weight_uses_given_scale():
    w = torch.randn(8, 4)
    q, s = quantize_weight(w, TensorSpec("int8", "per_channel", "calibrated"), scale=torch.full((8,), 0.01))
    assert torch.equal(s, torch.full((8,), 0.01))
    assert q.dtype is torch.int8
    with pytest.raises(ValueError):
        quantize_weight(w, TensorSpec("bf16"))


# ------------------------------------------------------------------------------------ fake_quant_linear


def _xw(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, 64, generator=g)
    return x, torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g)


def test_fp32_linear_is_the_plain_matmul():
    x, w, b = _xw()
    y = fake_quant_linear(x, w, PrecisionSpec.named("fp32"), bias=b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_bf16_linear_matches_bf16_inputs_with_fp32_accumulation():
    x, w, _ = _xw()
    y = fake_quant_linear(x, w, PrecisionSpec.named("bf16"))
    assert y.dtype is torch.bfloat16
    ref = (x.bfloat16().double() @ w.bfloat16().double().T).bfloat16()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_int8_linear_equals_the_integer_gemm():
    """Independent reference: int64 GEMM of the int8 codes, then scale_x * scale_w per output channel."""
    x, w, _ = _xw(1)
    spec = PrecisionSpec.from_dict({"preset": "int8", "compute": "fp32"})
    sx = compute_scale(amax_per_tensor(x), "int8")
    y = fake_quant_linear(x, w, spec, {"input": sx})
    qx = torch.round(x / sx).clamp(-127, 127).long()
    sw = w.abs().amax(dim=1) / 127
    qw = torch.round(w / sw[:, None]).clamp(-127, 127).long()
    ref = (qx @ qw.T).double() * sx.double() * sw.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_fp8_linear_error_is_small_but_real():
    x, w, b = _xw(2)
    spec = PrecisionSpec.named("fp8")
    sx = compute_scale(amax_per_tensor(x), "fp8_e4m3")
    y = fake_quant_linear(x, w, spec, {"input": sx}, bias=b).float()
    ref = torch.nn.functional.linear(x, w, b)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.06
    cos = torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.998


def test_calibrated_input_scale_is_required():
    x, w, _ = _xw()
    with pytest.raises(CalibrationError, match="no calibrated input scale"):
        fake_quant_linear(x, w, PrecisionSpec.named("fp8"))


def test_dynamic_activation_and_weight_only_paths():
    x, w, _ = _xw(3)
    dyn = PrecisionSpec.from_dict({"preset": "fp8", "activations": {"dtype": "fp8_e4m3", "scale": "dynamic"}})
    sx = compute_scale(amax_per_tensor(x), "fp8_e4m3")
    calibrated = fake_quant_linear(x, w, PrecisionSpec.named("fp8"), {"input": sx})
    torch.testing.assert_close(fake_quant_linear(x, w, dyn), calibrated)
    w_only = PrecisionSpec.from_dict({"weights": {"dtype": "int8", "granularity": "per_channel",
                                                  "scale": "dynamic"}})
    sw = compute_scale(amax_per_channel(w), "int8")
    torch.testing.assert_close(fake_quant_linear(x, w, w_only), x @ fake_quant(w, sw, "int8").T)
