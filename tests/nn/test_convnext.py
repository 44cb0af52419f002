"""ConvNeXt block (channels-last), AdaLayerNorm, the fused/prepacked linear, and the load-time folds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrt.nn.audio import ValidLength
from flashrt.nn.convnext import (
    AdaLayerNorm,
    ConvNeXtBlock,
    DepthwiseConv,
    FusedLinear,
    fold_norm_bias,
    fold_norm_weight,
    fold_scale,
    fold_scale_bias,
    taps_last,
    zero_padding_cl,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_depthwise_conv_equals_grouped_conv1d():
    torch.manual_seed(0)
    w, b, x = torch.randn(16, 1, 7), torch.randn(16), torch.randn(2, 11, 16)
    conv = DepthwiseConv(16, 7)
    with torch.no_grad():
        conv.weight.copy_(taps_last(w))
        conv.bias.copy_(b)
    ref = F.conv1d(x.transpose(1, 2), w, b, padding=3, groups=16).transpose(1, 2)
    torch.testing.assert_close(conv(x), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_linear_equals_linear_then_activation(activation, dtype):
    torch.manual_seed(1)
    lin = FusedLinear(24, 40, activation).to(dtype)
    lin.reset_derived()
    x = torch.randn(3, 5, 24, dtype=dtype)
    ref = F.linear(x, lin.weight, lin.bias)
    ref = F.gelu(ref) if activation == "gelu" else ref
    torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)


def test_fused_linear_repacks_on_reset_derived():
    lin = FusedLinear(8, 4)
    lin.reset_derived()
    x = torch.randn(2, 8)
    before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    lin.reset_derived()
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lin(x), before)


def test_fused_linear_refuses_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        FusedLinear(4, 4, "relu6")


def test_norm_and_scale_folds_are_exact_rewrites():
    torch.manual_seed(2)
    d, o = 12, 20
    g, beta = 1 + 0.3 * torch.randn(d), 0.2 * torch.randn(d)
    w, b, gamma = torch.randn(o, d), torch.randn(o), torch.randn(o)
    x = torch.randn(4, d)
    ref = gamma * F.linear(F.layer_norm(x, (d,), g, beta, eps=1e-6), w, b)
    w1, b1 = fold_norm_weight(w, g), fold_norm_bias(w, b, beta)
    out = F.linear(F.layer_norm(x, (d,), eps=1e-6), fold_scale(w1, gamma), fold_scale_bias(b1, gamma))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_ada_layer_norm_picks_scale_and_shift_per_row():
    torch.manual_seed(3)
    norm = AdaLayerNorm(3, 8)
    with torch.no_grad():
        norm.scale.weight.normal_()
        norm.shift.weight.normal_()
    x = torch.randn(2, 5, 8)
    cond = torch.tensor([2, 0])
    out = norm(x, cond)
    for row, c in enumerate(cond.tolist()):
        ref = F.layer_norm(x[row], (8,), eps=1e-6) * norm.scale.weight[c] + norm.shift.weight[c]
        torch.testing.assert_close(out[row], ref)
    torch.testing.assert_close(norm(x, torch.tensor([1]))[1], norm(x[1:], torch.tensor([1]))[0])


def _block_and_reference(adanorm: int | None):
    """A ConvNeXtBlock and the same computation in the Vocos (B, D, T) layout with unfolded params."""
    torch.manual_seed(4)
    d, i = 16, 32
    p = {"dw": torch.randn(d, 1, 7) * 0.3, "dwb": torch.randn(d) * 0.1, "g": 1 + 0.2 * torch.randn(d),
         "beta": 0.1 * torch.randn(d), "w1": torch.randn(i, d) * 0.2, "b1": torch.randn(i) * 0.1,
         "w2": torch.randn(d, i) * 0.2, "b2": torch.randn(d) * 0.1, "gamma": torch.randn(d)}
    block = ConvNeXtBlock(d, i, adanorm)
    with torch.no_grad():
        block.dwconv.weight.copy_(taps_last(p["dw"]))
        block.dwconv.bias.copy_(p["dwb"])
        w1, b1 = (p["w1"], p["b1"]) if adanorm else (fold_norm_weight(p["w1"], p["g"]),
                                                     fold_norm_bias(p["w1"], p["b1"], p["beta"]))
        block.pw1.weight.copy_(w1)
        block.pw1.bias.copy_(b1)
        block.pw2.weight.copy_(fold_scale(p["w2"], p["gamma"]))
        block.pw2.bias.copy_(fold_scale_bias(p["b2"], p["gamma"]))
        if adanorm:
            block.norm.scale.weight.copy_(p["g"].expand(adanorm, d))
            block.norm.shift.weight.copy_(p["beta"].expand(adanorm, d))
    block.pw1.reset_derived()
    block.pw2.reset_derived()

    def reference(x_bdt: torch.Tensor) -> torch.Tensor:
        h = F.conv1d(x_bdt, p["dw"], p["dwb"], padding=3, groups=d).transpose(1, 2)
        h = F.layer_norm(h, (d,), p["g"], p["beta"], eps=1e-6)
        h = p["gamma"] * F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
        return x_bdt + h.transpose(1, 2)
    return block, reference


@pytest.mark.parametrize("adanorm", [None, 3])
def test_convnext_block_equals_vocos_layout_reference(adanorm):
    block, reference = _block_and_reference(adanorm)
    x = torch.randn(2, 16, 13)
    cond = torch.tensor([1]) if adanorm else None
    out = block(x.transpose(1, 2).contiguous(), cond)
    torch.testing.assert_close(out.transpose(1, 2), reference(x), atol=1e-5, rtol=1e-5)


def test_convnext_block_with_padding_equals_unpadded_on_valid_frames():
    block, _ = _block_and_reference(None)
    block.requires_grad_(False)
    x = torch.randn(1, 9, 16)
    padded = torch.cat([x, torch.zeros(1, 7, 16)], dim=1)  # a block expects zero padding and leaves it
    out = block(padded, None, ValidLength(torch.tensor([9]), 16))
    torch.testing.assert_close(out[:, :9], block(x), atol=1e-5, rtol=1e-5)
    assert float(out[:, 9:].abs().max()) == 0.0
    garbage = torch.cat([x, 100 * torch.randn(1, 7, 16)], dim=1)
    assert not torch.allclose(block(garbage, None, ValidLength(torch.tensor([9]), 16))[:, :9], out[:, :9])


def test_zero_padding_channels_last_keeps_layout():
    x = torch.randn(2, 10, 4)
    y = zero_padding_cl(x, ValidLength(torch.tensor([6]), 10))
    assert y.is_contiguous() and float(y[:, 6:].abs().sum()) == 0.0
    torch.testing.assert_close(y[:, :6], x[:, :6])
