"""The time-major packed-GEMM coupling flow (flashrt/frontends/vits/flow.py) against the conv1d reference
form of `CouplingFlow`, with speakers, dilations and an odd number of Flips."""

from dataclasses import replace

import pytest
import torch

from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.flow import PackedFlow
from flashrt.frontends.vits.modules import CouplingFlow

pytestmark = pytest.mark.usefixtures("one_thread")


def _flow(cfg, seed: int = 0) -> CouplingFlow:
    torch.manual_seed(seed)
    flow = CouplingFlow(cfg)
    with torch.no_grad():
        for p in flow.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return flow


@pytest.mark.parametrize(
    "changes",
    [{}, {"flow_flows": 3, "flow_dilation_rate": 2, "flow_layers": 3}, {"gin_channels": 6, "n_speakers": 3}],
    ids=["tiny", "odd-flips-dilated", "speakers"],
)
def test_packed_flow_matches_the_conv_form(changes):
    cfg = replace(PRESETS["tiny"], **changes)
    flow = _flow(cfg)
    frames = 37
    z = torch.randn(1, cfg.inter_channels, frames, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 1, frames)
    mask[..., 30:] = 0  # a padded tail: its steps must not reach the real ones
    g = torch.randn(1, cfg.gin_channels, 1) if cfg.gin_channels else None
    with torch.no_grad():
        want = flow(z, mask, g) * mask
        flow.pack()
        assert isinstance(flow.packed, PackedFlow)
        got = flow(z, mask, g) * mask
        z2 = z.clone()
        z2[..., 30:] = 100.0  # garbage in the padding changes nothing real
        again = flow(z2, mask, g) * mask
    assert want.abs().max() > 0.1
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    assert (again - got).abs().max() <= 1e-5


def test_loaded_prior_runs_the_packed_forms():
    """load_weights derives the CPU float32 forms of the encoder, the duration predictor and the flow."""
    from support.vits import tiny_state

    from flashrt.frontends.vits.model import load_weights

    prior, _ = load_weights(tiny_state(), PRESETS["tiny"], conv="direct")
    assert isinstance(prior.flow.packed, PackedFlow)
    assert prior.enc_p.packed is not None and prior.dp.packed is not None
    prior.to(torch.float64)
    prior.pack()
    assert prior.flow.packed is None and prior.enc_p.packed is None and prior.dp.packed is None
