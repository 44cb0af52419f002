"""SNAC blocks (channels-last): snake, convs, GEMM transposed conv, local attention, residual/decoder
blocks, hashed noise, the multi-scale quantizer, and padded (ValidLength) runs. Each is checked against
torch's own ops or a naive loop; full-model parity with the `snac` package lives in
tests/frontends/vocoders/test_snac.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashrt.nn.audio import ValidLength
from flashrt.nn.snac_blocks import (
    ChannelsLastConv,
    DecoderBlock,
    LocalAttention,
    MonoOutputConv,
    SnacQuantizer,
    Snake,
    TransposedConv,
    convt_weight_to_gemm,
    hashed_normal,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for sub in module.modules():
        if hasattr(sub, "reset_derived"):
            sub.reset_derived()
    return module.eval().requires_grad_(False)  # as load_module returns it


def _cl(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) -> contiguous (B, T, C)."""
    return x.transpose(1, 2).contiguous()


def test_snake_formula():
    snake = _randomize(Snake(5), 0)
    x = torch.randn(2, 9, 5)
    a = snake.alpha
    torch.testing.assert_close(snake(x), x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2))


@pytest.mark.parametrize("dilation,groups,t", [(1, 8, 20), (3, 8, 20), (9, 8, 21), (9, 1, 40), (3, 2, 7)])
def test_channels_last_conv_equals_conv1d(dilation, groups, t):
    conv = _randomize(ChannelsLastConv(8, 8, 7, dilation, groups), dilation)
    x = torch.randn(2, 8, t)
    ref = F.conv1d(x, conv.weight, conv.bias, padding=3 * dilation, dilation=dilation, groups=groups)
    out = conv(_cl(x))
    assert out.is_contiguous()
    torch.testing.assert_close(out, _cl(ref), atol=1e-5, rtol=1e-5)


def test_mono_output_conv_equals_conv1d():
    conv = _randomize(MonoOutputConv(6, 7), 1)
    x = torch.randn(2, 6, 30)
    ref = F.conv1d(x, conv.weight, conv.bias, padding=3)[:, 0]
    torch.testing.assert_close(conv(_cl(x)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [2, 3, 4, 5, 8])
def test_transposed_conv_equals_torch(stride):
    kernel, pad, out_pad = 2 * stride, math.ceil(stride / 2), stride % 2
    torch.manual_seed(stride)
    w, b, x = torch.randn(6, 4, kernel), torch.randn(4), torch.randn(2, 6, 11)
    conv = TransposedConv(6, 4, kernel, stride, pad, out_pad).requires_grad_(False)
    with torch.no_grad():
        conv.gemm.weight.copy_(convt_weight_to_gemm(w))
        conv.bias.copy_(b)
    conv.gemm.reset_derived()
    ref = F.conv_transpose1d(x, w, b, stride, pad, out_pad)
    assert ref.shape[-1] == conv.output_length(11) == 11 * stride
    torch.testing.assert_close(conv(_cl(x)), _cl(ref), atol=1e-5, rtol=1e-5)


def test_transposed_conv_refuses_kernels_that_are_not_stride_multiples():
    with pytest.raises(ValueError, match="multiple of stride"):
        TransposedConv(3, 2, 5, 2, 1, 0)


def _naive_local_attention(attn: LocalAttention, x: torch.Tensor) -> torch.Tensor:
    """x (B, T, C). Window by window, head by head, explicit softmax and rotary from the definition."""
    b, t, c = x.shape
    n, e = attn.window, 64
    h = F.layer_norm(x, (c,), attn.norm.weight, attn.norm.bias, eps=1e-5)
    q, k, v = (h @ attn.to_qkv.weight.T).split(c, dim=-1)
    inv = 1.0 / 10000 ** (torch.arange(0, e, 2).float() / e)
    ang = torch.arange(n).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)

    def rot(u):
        return u * ang.cos() + torch.cat([-u[..., e // 2:], u[..., :e // 2]], -1) * ang.sin()

    out = torch.zeros(b, t, c)
    for w in range(t // n):
        sl = slice(w * n, (w + 1) * n)
        for head in range(c // e):
            hs = slice(head * e, (head + 1) * e)
            qq, kk, vv = rot(q[:, sl, hs]), rot(k[:, sl, hs]), v[:, sl, hs]
            p = torch.softmax(qq @ kk.transpose(1, 2) / math.sqrt(e), dim=-1)
            out[:, sl, hs] = p @ vv
    return out @ attn.to_out.weight.T + x


def test_local_attention_equals_naive_windows():
    attn = LocalAttention(128, 4)
    _randomize(attn, 1)
    with torch.no_grad():
        attn.norm.weight.add_(1.0)
    x = torch.randn(2, 12, 128)
    torch.testing.assert_close(attn(x), _naive_local_attention(attn, x), atol=1e-4, rtol=1e-4)


def test_local_attention_refuses_widths_that_are_not_whole_heads():
    with pytest.raises(ValueError, match="multiple of the head size"):
        LocalAttention(96, 4)


def test_hashed_normal_is_positional_and_deterministic():
    seed = torch.tensor([7, 8])
    full = hashed_normal(seed, 2, 0, 300)
    torch.testing.assert_close(hashed_normal(seed, 2, torch.tensor(100), 200), full[..., 100:])
    assert torch.equal(hashed_normal(seed, 2, 0, 300), full)
    assert not torch.allclose(full[0], full[1])                            # seeds differ
    assert not torch.allclose(hashed_normal(seed, 3, 0, 300), full)        # streams differ
    assert full.shape == (2, 300) and full.dtype == torch.float32


def test_hashed_normal_looks_standard_normal():
    x = hashed_normal(torch.tensor([123]), 0, 2**32 - 50_000, 100_000).flatten()
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1) < 0.02
    assert abs(float((x > 1.96).float().mean()) - 0.025) < 0.005
    assert bool(torch.isfinite(x).all())


def test_quantizer_sums_projected_repeated_codebook_rows():
    q = _randomize(SnacQuantizer(6, 10, 3, (4, 2, 1)), 2)
    codes = [torch.randint(0, 10, (2, 8 // s)) for s in (4, 2, 1)]
    z = q(codes)
    ref = torch.zeros(2, 8, 6)
    for i, s in enumerate((4, 2, 1)):
        for t in range(8):
            row = q.codebooks[i][codes[i][:, t // s]]  # (B, d)
            ref[:, t] += row @ q.proj[i].weight.T + q.proj[i].bias
    torch.testing.assert_close(z, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride,noise", [(2, False), (3, True)])
def test_decoder_block_with_padding_equals_unpadded_on_valid_samples(stride, noise):
    block = _randomize(DecoderBlock(8, 4, stride, noise, groups=4), 3)
    x = torch.randn(1, 10, 8)
    padded = torch.cat([x, 30 * torch.randn(1, 6, 8)], dim=1)
    n_pad = torch.randn(1, 16 * stride, 1) if noise else None
    out = block(padded, n_pad, ValidLength(torch.tensor([10]), 16))
    ref = block(x, None if n_pad is None else n_pad[:, :10 * stride])
    torch.testing.assert_close(out[:, :10 * stride], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [2, 3])
def test_decoder_block_reach_covers_the_measured_receptive_field(stride):
    """Perturb one input step; every output sample that moves lies within the declared reach."""
    block = _randomize(DecoderBlock(4, 4, stride, False, groups=4), 4)
    x = torch.randn(1, 40, 4)
    base = block(x)
    x2 = x.clone()
    x2[:, 20] += 1.0
    moved = ((block(x2) - base).abs().amax(-1)[0] > 0).nonzero().flatten() / stride  # in input steps
    reach = block.reach(1)
    assert float(20 - moved.min()) <= float(reach.right) + 1e-9   # outputs left of 20 look right to it
    assert float(moved.max() - 20) <= float(reach.left) + 1.0      # +1: the step's own samples
