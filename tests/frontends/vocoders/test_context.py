"""Streaming context derived from the built modules (`module.reach()`, flashrt.nn.reach): equal to the
per-family hand walks it replaced, covering the receptive field measured by perturbing one input frame,
and needed: with one frame less the stream no longer equals the one-shot output."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from flashrt.frontends.vocoders import get_family
from flashrt.nn.audio import Reach
from flashrt.runner.vocoder import Vocoder
from flashrt.testing.synthetic.vocoders import random_module

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the hand walks the modules replaced

def _resblock(kind: str, k: int, dilations, rate: int, act: Reach) -> Reach:
    if kind == "1":
        return sum((act + Reach.conv(k, d, rate) + act + Reach.conv(k, 1, rate) for d in dilations), Reach())
    return sum((act + Reach.conv(k, d, rate) for d in dilations), Reach())


def _act(rate: int) -> Reach:
    half = Fraction(12, 4)
    return Reach(half / rate, half / rate) + Reach(Fraction(6, 2 * rate), Fraction(6, 2 * rate))


def _generator(cfg, kind: str, snake: bool) -> Reach:
    reach, rate = Reach.conv(7), 1
    for u, k in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes):
        reach = reach + Reach.conv_transpose(k, u, (k - u) // 2, rate)
        rate *= u
        act = _act(rate) if snake else Reach()
        reach = reach + Reach.widest([_resblock(kind, bk, bd, rate, act) for bk, bd in
                                      zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)])
    return reach + (_act(rate) if snake else Reach()) + Reach.conv(7, rate=rate)


def _hand_context(family: str, cfg) -> tuple[int, int]:
    if family in ("hifigan", "bigvgan"):
        left, right = _generator(cfg, cfg.resblock, family == "bigvgan").frames()
        return left + 1, right + 1
    if family == "vocos":
        trim = cfg.n_fft // 2 if cfg.padding == "center" else (cfg.n_fft - cfg.hop_length) // 2
        istft = Reach(Fraction(cfg.n_fft - 1 - trim, cfg.hop_length), Fraction(trim, cfg.hop_length))
        return (sum((Reach.conv(7) for _ in range(cfg.num_layers + 1)), Reach()) + istft).frames()
    rate = cfg.latents_per_frame                                   # snac
    pre, rest = Reach.conv(7, rate=rate), Reach()
    for s in cfg.decoder_rates:
        rest = rest + Reach.conv_transpose(2 * s, s, math.ceil(s / 2), rate)
        rest = rest + sum((Reach.conv(7, d, rate * s) for d in (1, 3, 9)), Reach())
        rate *= s
    rest = rest + Reach.conv(7, rate=rate)
    if not cfg.attn_window_size:
        return (pre + rest).frames()
    (pl, pr), (rl, rr) = pre.frames(), rest.frames()
    return pl + rl, pr + rr


@pytest.mark.parametrize("family", ["hifigan", "bigvgan", "vocos", "snac"])
def test_derived_context_equals_the_hand_walks(family):
    """Every preset, released sizes included: the module-derived context is what the families declared
    before, when each walked its own layer list with the kernel sizes written out."""
    fam = get_family(family)
    for name, cfg in fam.presets.items():
        assert fam.signature(cfg).context == _hand_context(family, cfg), name


# ----------------------------------------------------------------------- measured: covers and needed

def _measured(family: str, preset: str, frames: int = 90, at: int = 45) -> tuple[int, int]:
    """(left, right) frames of context an output frame needs, measured in float64 with zero biases and a
    zero input but one frame: the outputs that move are exactly those whose receptive field holds it."""
    fam = get_family(family)
    cfg = fam.presets[preset]
    module = random_module(fam, cfg, 3, "cpu", torch.float64)
    spec, hop = fam.signature(cfg).inputs[0], fam.signature(cfg).hop_length
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        x = torch.zeros(1, spec.channels, frames, dtype=torch.float64)
        bumped = x.clone()
        bumped[..., at] = 1.0
        moved = ((module(bumped) - module(x))[0] != 0).nonzero().flatten() // hop
    return int(moved.max()) - at, at - int(moved.min())


@pytest.mark.parametrize("family,preset", [("hifigan", "tiny"), ("hifigan", "tiny-resblock2"),
                                           ("bigvgan", "tiny-snake2"), ("vocos", "tiny")])
def test_context_covers_the_measured_receptive_field(family, preset):
    """Never short (a stream would differ), and little slack: HiFi-GAN rounds its fractional reach up and
    adds one frame (2 frames per side), BigVGAN also bounds its resamplers' reach (3), Vocos rounds up (1)."""
    declared = get_family(family).signature(get_family(family).presets[preset]).context
    measured = _measured(family, preset)
    slack = {"hifigan": 2, "bigvgan": 3, "vocos": 1}[family]
    assert all(0 <= d - m <= slack for d, m in zip(declared, measured)), (declared, measured)


@pytest.mark.parametrize("family,preset,sides", [("vocos", "tiny", ((0, -1),)),
                                                 ("snac", "tiny", ((-1, 0), (0, -2))),
                                                 ("hifigan", "tiny", ((0, -2),))])
def test_less_context_breaks_the_stream(family, preset, sides):
    """With the declared context the stream equals the one-shot output; with one frame less on a side
    where the measured receptive field ends at the declared one it does not (HiFi-GAN's right side and
    SNAC's: two frames less, what the last frame adds is below the 1e-5 tolerance at these sizes)."""
    fam = get_family(family)
    cfg = fam.presets[preset]
    # gain 1: weights large enough that the last frame of context shows above 1e-5 at these sizes
    voc = Vocoder(fam, cfg, random_module(fam, cfg, 3, "cpu", torch.float32, gain=1.0), buckets=(128,),
                  stream_chunk=2).capture()
    left, right = voc.frontend.context
    g = torch.Generator().manual_seed(0)
    x = [torch.randint(0, s.high + 1, (1, (left + right + 12) * s.rate), generator=g) if s.is_codes
         else torch.randn(1, s.channels, left + right + 12, generator=g) for s in voc.signature.inputs]
    whole = voc(*x)
    assert (torch.cat(list(voc.stream([tuple(x)])), -1) - whole).abs().max() <= 1e-5
    for dl, dr in sides:
        voc.frontend.context = (left + dl, right + dr)
        assert (torch.cat(list(voc.stream([tuple(x)])), -1) - whole).abs().max() > 1e-5, (dl, dr)
