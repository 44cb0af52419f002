"""flashrt.runtime.rtc against the equations written out by hand (Black et al. 2025, section 4, with
the identity Jacobian lerobot uses) on a toy flow, plus the weight schedules and the gain table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashrt.errors import InputError
from flashrt.runtime.rtc import Guidance, guidance_gains, guided_velocity, prefix_weights


@pytest.mark.parametrize(("delay", "horizon", "total", "schedule", "want"), [
    (2, 5, 6, "linear", [1, 1, 0.75, 0.5, 0.25, 0]),
    (0, 3, 4, "linear", [0.75, 0.5, 0.25, 0]),
    (3, 3, 5, "linear", [1, 1, 1, 0, 0]),
    (4, 2, 5, "linear", [1, 1, 0, 0, 0]),  # delay past the horizon: clipped to it
    (2, 5, 6, "zeros", [1, 1, 0, 0, 0, 0]),
    (2, 5, 6, "ones", [1, 1, 1, 1, 1, 0]),
    (1, 9, 4, "linear", [1, 0.75, 0.5, 0.25]),  # horizon past the chunk
])
def test_prefix_weights(delay, horizon, total, schedule, want):
    np.testing.assert_allclose(prefix_weights(delay, horizon, total, schedule), want, atol=1e-7)


def test_exp_schedule_is_ramp_times_expm1():
    r = np.array([0.75, 0.5, 0.25])
    want = [1, 1, *(r * np.expm1(r) / (math.e - 1)), 0]
    np.testing.assert_allclose(prefix_weights(2, 5, 6, "exp"), want, atol=1e-6)


def test_gains_follow_the_paper_and_are_capped():
    """g(t) = min(beta, (1 - tau) / tau * (tau^2 + (1 - tau)^2) / (1 - tau)^2), tau = 1 - t."""
    n, beta = 5, 4.0
    gains = guidance_gains(n, beta).numpy()
    for s in range(n):
        t = 1 - s / n
        tau = 1 - t
        want = beta if tau == 0 else min(beta, (1 - tau) / tau * (tau**2 + (1 - tau) ** 2) / (1 - tau) ** 2)
        assert gains[s] == pytest.approx(want, rel=1e-6), s


def _toy_velocity(x: torch.Tensor, t: float, target: torch.Tensor) -> torch.Tensor:
    """Rectified flow from noise (t = 1) to `target` (t = 0): v = (x - target) / t."""
    return (x - target) / t


def test_guided_integration_on_a_toy_flow_pulls_the_prefix_to_the_frozen_actions():
    """Euler from t = 1 to 0 with v' = v - g(t) (Y - (x - t v)) W; the weight-1 rows land on Y, the
    weight-0 rows are the unguided flow's."""
    torch.manual_seed(0)
    h, a, n = 6, 3, 10
    target, frozen, noise = torch.randn(h, a), torch.randn(h, a), torch.randn(h, a)
    w = torch.from_numpy(prefix_weights(2, 4, h))[:, None]
    gains = guidance_gains(n, 10.0)
    x_plain, x = noise.clone(), noise.clone()
    for s in range(n):
        t = 1 - s / n
        x_plain = x_plain + (-1 / n) * _toy_velocity(x_plain, t, target)
        v = _toy_velocity(x, t, target)
        by_hand = v - gains[s] * (frozen - (x - t * v)) * w
        guided = guided_velocity(v, x, torch.tensor(t), frozen, w, gains[s])
        torch.testing.assert_close(guided, by_hand, rtol=0, atol=1e-6)
        x = x + (-1 / n) * guided
    assert (x[:2] - frozen[:2]).abs().max() < 0.1 * (target[:2] - frozen[:2]).abs().max()
    torch.testing.assert_close(x[4:], x_plain[4:], rtol=0, atol=0)
    torch.testing.assert_close(x_plain, target, rtol=0, atol=1e-5)


def test_zero_weights_give_the_velocity_bit_for_bit():
    v, x, f = torch.randn(1, 4, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 2)
    out = guided_velocity(v, x, torch.tensor(0.7), f, torch.zeros(1, 4, 1), torch.tensor(10.0))
    assert torch.equal(out, v)


def test_guidance_checks():
    g = Guidance(np.zeros((2, 3), np.float32), 1, 2)
    assert g.check(4, 3).shape == (2, 3)
    with pytest.raises(InputError, match="frozen"):
        g.check(1, 3)
    with pytest.raises(InputError, match="horizon"):
        Guidance(np.zeros((2, 3), np.float32), 1, True).check(4, 3)
