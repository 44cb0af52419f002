"""Real-time chunking (RTC): guide a flow-matching chunk to agree with actions already committed.

Black, Galliker, Levine, "Real-Time Execution of Action Chunking Flow Policies" (2025). While chunk
k+1 is being inferred, the robot keeps executing chunk k; the first `delay` actions of chunk k+1 are
therefore frozen (they will be chunk k's). Inference is treated as inpainting: at every denoising step
the velocity is corrected toward the frozen prefix, weighted per position by `prefix_weights` (1 on
the frozen actions, decaying over the rest of the overlap, 0 beyond the execution horizon).

Conventions (flow time t from 1 = noise to 0 = actions, Euler step dt = -1/n, as Pi0 / lerobot):

    x1_hat = x_t - t * v_t                    the clean actions the current velocity points to
    err    = (Y - x1_hat) * W                 Y frozen prefix (zero-padded), W (H,) weights
    v'     = v_t - g(t) * err                 g(t) = min(beta, (t / (1 - t)) * (t^2 + (1 - t)^2) / t^2)
                                              (tau = 1 - t; inf at t = 1 becomes beta)

This is the guidance of the paper with the denoiser's Jacobian taken as the identity
(d x1_hat / d x_t = I, i.e. no vector-Jacobian product through the network), exactly as lerobot 0.6.1's
``RTCProcessor.denoise_step`` computes it (its autograd call differentiates only ``x_t - t * v_t``, the
velocity having been computed before ``x_t`` required grad). It needs no backward pass, so it is a
handful of elementwise ops inside the captured step: `guided_velocity` runs there, reading the frozen
prefix, its weights and the per-step gains from static input buffers that the runner rewrites before
each replay. With W = 0 the result is v_t bit for bit (the unguided step).

Everything here knows no model: a family's step calls `guided_velocity`; the runner builds a
`Guidance` (what is frozen, how it is weighted) and the family writes it into its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashrt.errors import InputError

__all__ = ["Guidance", "SCHEDULES", "prefix_weights", "guidance_gains", "guided_velocity", "euler_times_f32"]

SCHEDULES = ("zeros", "ones", "linear", "exp")


@dataclass(frozen=True)
class Guidance:
    """What a guided chunk must agree with.

    frozen        (k, action_dim) float32: actions (in the policy's action space, as `infer` returns
                  them) that positions 0..k-1 of the new chunk should reproduce; k <= chunk size
    delay         positions that execute while this chunk is inferred (weight 1)
    horizon       positions after which the weight is 0 (the overlap with the old chunk); >= delay
    schedule      weights between delay and horizon: "linear" (lerobot's default), "exp", "ones", "zeros"
    max_guidance  beta, the cap of the guidance gain (lerobot's max_guidance_weight, default 10)
    """

    frozen: np.ndarray
    delay: int
    horizon: int
    schedule: str = "linear"
    max_guidance: float = 10.0

    def weights(self, total: int) -> np.ndarray:
        horizon = min(self.horizon, self.frozen.shape[0])
        return prefix_weights(self.delay, horizon, total, self.schedule)

    def check(self, chunk_size: int, action_dim: int) -> np.ndarray:
        """The frozen actions as (k, action_dim) float32, every field checked (InputError)."""
        f = np.asarray(self.frozen)
        if f.ndim != 2 or f.shape[1] != action_dim or not 0 < f.shape[0] <= chunk_size:
            raise InputError(f"guidance: frozen actions must be (k <= {chunk_size}, {action_dim}), "
                             f"got {f.shape}")
        if f.dtype.kind not in "fiu" or not np.isfinite(f).all():
            raise InputError("guidance: frozen actions must be finite numbers")
        for name, value in (("delay", self.delay), ("horizon", self.horizon)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise InputError(f"guidance: {name} must be a non-negative int, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise InputError(f"guidance: schedule {self.schedule!r} is not one of {SCHEDULES}")
        if not (isinstance(self.max_guidance, int | float) and 0 < self.max_guidance < 1e6):
            raise InputError(f"guidance: max_guidance must be a positive number, got {self.max_guidance!r}")
        return f.astype(np.float32)


def prefix_weights(delay: int, horizon: int, total: int, schedule: str = "linear") -> np.ndarray:
    """(total,) float32: 1 on [0, delay), a ramp from 1 to 0 (exclusive) on [delay, horizon), 0 after.

    "linear": the ramp is linspace(1, 0, m + 2)[1:-1] over the m = horizon - delay positions;
    "exp": that ramp r times expm1(r) / (e - 1); "ones": 1 up to the horizon; "zeros": 1 up to delay.
    Matches lerobot 0.6.1's `RTCProcessor.get_prefix_weights` (its start = delay, end = horizon)."""
    delay = min(delay, horizon)
    w = np.zeros(total, dtype=np.float32)
    if schedule == "zeros":
        w[:delay] = 1.0
        return w
    if schedule == "ones":
        w[:horizon] = 1.0
        return w
    m = min(horizon, total) - delay
    if m > 0:
        ramp = torch.linspace(1, 0, m + 2)[1:-1]
        if schedule == "exp":
            ramp = ramp * torch.expm1(ramp).div(np.e - 1)
        w[delay: delay + m] = ramp.numpy()
    w[: min(delay, total)] = 1.0
    return w


def euler_times_f32(num_steps: int) -> torch.Tensor:
    """(n,) float32 flow times 1, 1 - 1/n, ..., 1/n (Python double, then float32)."""
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + s * dt for s in range(num_steps)], dtype=torch.float32)


def guidance_gains(num_steps: int, max_guidance: float) -> torch.Tensor:
    """(n,) float32 g(t) per Euler step (module docstring), computed in float32 like lerobot."""
    beta = torch.as_tensor(float(max_guidance), dtype=torch.float32)
    out = []
    for s in range(num_steps):
        t = 1.0 + s * (-1.0 / num_steps)
        tau = torch.as_tensor(1.0 - t, dtype=torch.float32)
        inv_r2 = ((1 - tau) ** 2 + tau**2) / (1 - tau) ** 2
        c = torch.nan_to_num((1 - tau) / tau, posinf=float(beta))
        out.append(torch.minimum(torch.nan_to_num(c * inv_r2, posinf=float(beta)), beta))
    return torch.stack(out)


def guided_velocity(v: torch.Tensor, x: torch.Tensor, time: torch.Tensor, frozen: torch.Tensor,
                    weights: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """v - gain * ((frozen - (x - time * v)) * weights): static shapes, no host sync (graph-safe).

    v, x, frozen (B, H, A) float32; weights (B, H, 1); time and gain 0-d float32 tensors."""
    return v - gain * ((frozen - (x - time * v)) * weights)
