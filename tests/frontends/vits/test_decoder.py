"""VitsDecoder: HifiGan's arithmetic with the MRF stages in reused per-thread buffers."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashrt.frontends.vits.decoder import VitsDecoder
from flashrt.frontends.vocoders.hifigan import PRESETS, HifiGan
from flashrt.nn.conv_policy import POLICIES, apply_conv_policy
from flashrt.nn.spectral_conv import _Scratch
from flashrt.nn.valid import ValidLength
from flashrt.testing.synthetic.vocoders import random_module

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = PRESETS["tiny-resblock2"]


def _decoder(conv: str, tile_above: int = 4) -> VitsDecoder:
    """tiny-resblock2 (hop 8) with random weights; the last stage tiled above ``tile_above`` frames in
    tiles of 16 frames (128 steps)."""
    module = random_module(types.SimpleNamespace(name="hifigan", build=VitsDecoder), CFG, 0, "cpu",
                           torch.float32)
    apply_conv_policy(module, POLICIES[conv])
    module.tile_frames, module.tile_above = 16, tile_above
    return module


def _call(dec, frames: int, valid: int, seed: int, forward=VitsDecoder.forward) -> torch.Tensor:
    z = torch.randn(1, CFG.in_channels, frames, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = forward(dec, z, ValidLength(torch.tensor([valid]), frames))
    return out[:, :valid * CFG.hop_length]


@pytest.mark.parametrize("tile_above", [4, 10_000])
@pytest.mark.parametrize("conv", ["direct", "auto", "invariant"])
def test_reused_buffers_and_tiles_give_hifigan_audio(conv, tile_above):
    """HifiGan.forward's audio (to fp32 rounding: the last stage's tiles start elsewhere), padded calls
    over one tile, several and a partial last one; the same bits again after a longer call (stale values
    in the reused buffers and the tile window never reach the audio)."""
    dec = _decoder(conv, tile_above)
    assert all(p is not None for p in dec.ups_packed)
    first = _call(dec, 40, 33, 1)
    for frames, valid in ((40, 33), (96, 90), (16, 16), (9, 4), (3, 3)):
        got, want = _call(dec, frames, valid, 2), _call(dec, frames, valid, 2, HifiGan.forward)
        assert (got - want).abs().max() <= 1e-6
        assert 0.01 < want.abs().mean() < 0.9
    assert torch.equal(_call(dec, 40, 33, 1), first)


def test_tiles_cover_every_step_once_with_a_half_tile_at_the_end():
    from flashrt.frontends.vits.decoder import tiles

    assert tiles(4096 * 3 + 2048, 4096) == [(0, 4096), (4096, 4096), (8192, 4096), (12288, 2048)]
    assert tiles(4096 + 2049, 4096) == [(0, 4096), (4096, 4096)]
    assert tiles(100, 4096) == [(0, 2048)]
    for steps in range(1, 300):
        got = tiles(steps, 64)
        assert got[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(got, got[1:]))
        assert got[-1][0] < steps <= sum(got[-1]) and {n for _, n in got} <= {32, 64}


def test_plain_eager_calls_reuse_the_stage_buffers():
    """The stage tensors live in this thread's scratch (no fresh multi-megabyte tensors per call): the
    buffers exist after a call and a second call of the same length takes the same memory."""
    dec = _decoder("direct")
    _call(dec, 64, 64, 0)
    held = {k[0]: b.data_ptr() for k, b in _Scratch._local.buffers.items() if k[0].startswith("vits.")}
    assert set(held) == {"vits.act", "vits.out", "vits.block", "vits.lrelu", "vits.window"}
    _call(dec, 64, 64, 1)
    again = {k[0]: b.data_ptr() for k, b in _Scratch._local.buffers.items() if k[0].startswith("vits.")}
    assert again == held


def test_recording_modes_get_fresh_tensors_and_the_same_result():
    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    dec = _decoder("direct")
    want = _call(dec, 48, 40, 3)
    with Passthrough():
        got = _call(dec, 48, 40, 3)
    assert (got - want).abs().max() <= 1e-6
