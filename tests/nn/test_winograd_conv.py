"""Winograd F(4, 3) for 3-tap convs: against float64 at every length and dilation, the policy's choice,
and the direct conv wherever the native form does not run (recording modes, export forms, no library)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn import winograd_conv
from flashrt.nn.audio import Conv1d, to_rows
from flashrt.nn.conv1d import plain_forms
from flashrt.nn.conv_policy import POLICIES, apply_conv_policy
from flashrt.nn.spectral_conv import grouped_products

pytestmark = pytest.mark.usefixtures("one_thread")


def _ready() -> None:
    if winograd_conv._kernels() is None or not grouped_products():
        pytest.skip("needs the CPU library (a C compiler) and oneDNN's AVX-512 grouped conv")


def _conv(channels: int, dilation: int, policy: str = "auto") -> Conv1d:
    torch.manual_seed(channels + dilation)
    conv = Conv1d(channels, channels, 3, dilation)
    conv.reset_derived()
    apply_conv_policy(nn.Sequential(conv), POLICIES[policy])
    return conv


@pytest.mark.parametrize("channels,dilation", [(128, 1), (128, 3), (256, 5)])
@pytest.mark.parametrize("steps,batch", [(1, 1), (2, 1), (5, 2), (13, 1), (64, 1), (401, 2)])
def test_matches_float64_at_every_length(channels, dilation, steps, batch):
    """Within 8x the direct conv's own error against float64, or 4e-6 of the output's scale (F(4, 3)'s
    transforms reach 8 and 5: 2-8x direct's error measured), epilogues included; output in rows layout."""
    _ready()
    conv = _conv(channels, dilation)
    assert conv.winograd is not None
    x = to_rows(torch.randn(batch, channels, steps, generator=torch.Generator().manual_seed(steps)))
    residual = to_rows(torch.randn(batch, channels, steps))
    weight, bias = conv.weight.detach().double(), conv.bias.detach().double()
    ref = F.conv1d(x.squeeze(2).double(), weight, bias, padding=dilation, dilation=dilation)
    calls = []
    conv.winograd.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        got = conv(x, slope=0.1)
        summed = conv(x, residual=residual)
    assert calls == [1, 1] and got.shape == x.shape and got.is_contiguous(memory_format=torch.channels_last)
    conv.winograd = None
    with torch.no_grad():
        direct = conv(x)
    bound = max(8 * float((direct.squeeze(2).double() - ref).abs().max()), 4e-6 * float(ref.abs().max()))
    assert float((got.squeeze(2).double() - F.leaky_relu(ref, 0.1)).abs().max()) <= bound
    assert float((summed.squeeze(2).double() - ref - residual.squeeze(2)).abs().max()) <= bound


def test_policy_takes_3_tap_convs_at_128_and_256_channels_only():
    _ready()
    net = nn.Sequential(Conv1d(256, 256, 3, 5), Conv1d(128, 128, 3), Conv1d(64, 64, 3), Conv1d(128, 128, 5),
                        Conv1d(128, 64, 3))
    for conv in net:
        conv.reset_derived()
    chosen = apply_conv_policy(net, POLICIES["auto"])
    assert chosen["winograd"] == ["0", "1"]
    for policy in ("direct", "invariant", "spectral"):
        assert apply_conv_policy(net, POLICIES[policy])["winograd"] == []
        assert all(conv.winograd is None for conv in net)
    apply_conv_policy(net, POLICIES["auto"])
    net[0].reset_derived()                                              # a reload keeps the form
    assert net[0].winograd is not None


def test_recordings_and_export_forms_run_the_direct_conv():
    """Under a recording mode (trace backend, FLOP counters) and inside `plain_forms` (export) the
    conv runs oneDNN's direct form, bit for bit the policy-free conv."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _ready()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    conv = _conv(128, 3)
    x = to_rows(torch.randn(1, 128, 100))
    with torch.no_grad():
        with Ops():
            recorded = conv(x)
        with plain_forms():
            exported = conv(x)
        fast = conv(x)
        conv.winograd = None
        direct = conv(x)
    assert torch.equal(recorded, direct) and torch.equal(exported, direct)
    assert not torch.equal(fast, direct) and (fast - direct).abs().max() <= 1e-5


@pytest.mark.parametrize("dilation", [1, 3, 5])
def test_padded_call_never_reads_stale_padding(dilation):
    """A padded call zeroes every step the valid outputs' tiles read (6 d past the end, not only the
    taps' halo d): the transforms mix a tile's 6 inputs, so stale padding would move the valid outputs
    at the rounding level. The scratch a longer call left (poisoned here) is never read either."""
    from flashrt.nn.spectral_conv import _Scratch
    from flashrt.nn.valid import ValidLength

    _ready()
    conv = _conv(128, dilation)
    gen = torch.Generator().manual_seed(dilation)
    steps = 160
    for end in (1, 37, 81, 150, 159):
        x = torch.randn(1, 128, steps, generator=gen)
        x[..., end:] = 0
        stale = x.clone()
        stale[..., end:] = 100 * torch.randn(1, 128, steps - end, generator=gen)
        with torch.no_grad():
            zeros = conv(to_rows(x), ValidLength(torch.tensor([end]), steps))[..., :end]
            conv(to_rows(torch.randn(1, 128, 4 * steps, generator=gen)))
            with torch.inference_mode():  # earlier tests may have left inference-mode scratch buffers
                for buf in _Scratch._local.buffers.values():
                    buf.fill_(float("nan"))
            got = conv(to_rows(stale), ValidLength(torch.tensor([end]), steps))[..., :end]
        assert torch.equal(zeros, got)
