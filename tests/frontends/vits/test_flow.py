"""The time-major packed-GEMM coupling flow (flashrt/frontends/vits/flow.py) against the conv1d reference
form of `CouplingFlow`, with speakers, dilations and an odd number of Flips."""

from dataclasses import replace

import pytest
import torch

from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.flow import PackedFlow
from flashrt.frontends.vits.modules import CouplingFlow
from flashrt.nn.packed_linear import PackedLinear

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


def test_loaded_prior_runs_the_packed_flow():
    from flashrt.frontends.vits.model import load_weights
    from tests.frontends.vits.test_vits import _tiny_state

    prior, _ = load_weights(_tiny_state(), PRESETS["tiny"], conv="direct")
    assert isinstance(prior.flow.packed, PackedFlow)
    prior.to(torch.float64)
    prior.flow.pack()
    assert prior.flow.packed is None  # float64 runs the conv form


def test_packed_linear_fuses_activation_and_residual():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    x, other = torch.randn(53, 40, generator=gen), torch.randn(53, 24, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    for act, fn in (("none", lambda y: y), ("tanh", torch.tanh), ("sigmoid", torch.sigmoid)):
        assert (PackedLinear(w, b, act)(x) - fn(ref)).abs().max() <= 1e-5
    assert (PackedLinear(w, b)(x, other=other) - (ref + other)).abs().max() <= 1e-5
    b2 = torch.randn(24, generator=gen)
    assert (PackedLinear(w, b)(x, bias=b2) - torch.nn.functional.linear(x, w, b2)).abs().max() <= 1e-5
    with pytest.raises(ValueError):
        PackedLinear(w, b, "tanh")(x, other=other)
