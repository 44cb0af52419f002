"""The time-major stochastic duration predictor (flashrt/frontends/vits/duration.py) against the conv form
of `StochasticDurationPredictor`, with speakers and an odd number of Flips."""

from dataclasses import replace

import pytest
import torch

from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.modules import StochasticDurationPredictor

pytestmark = pytest.mark.usefixtures("one_thread")


def _module(cfg, seed: int = 0):
    torch.manual_seed(seed)
    module = StochasticDurationPredictor(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return module


@pytest.mark.parametrize(
    "changes",
    [{}, {"sdp_flows": 3}, {"gin_channels": 6, "n_speakers": 3}],
    ids=["tiny", "odd-flips", "speakers"],
)
def test_packed_duration_predictor_matches_the_conv_form(changes):
    cfg = replace(PRESETS["tiny"], **changes)
    dp = _module(cfg)
    p, real = 21, 15
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.hidden_channels, p, generator=gen)
    noise = torch.randn(1, 2, p, generator=gen)
    mask = torch.ones(1, 1, p)
    mask[..., real:] = 0
    g = torch.randn(1, cfg.gin_channels, 1, generator=gen) if cfg.gin_channels else None
    with torch.no_grad():
        want = dp(x, mask, noise, g)
        dp.pack()
        assert dp.packed is not None
        got = dp(x, mask, noise, g)
    assert want.abs().max() > 0.1
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
