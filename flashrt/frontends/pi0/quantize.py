"""Pi0 / Pi0.5 in int8 (W8A8) or fp8: calibration samples, the eager run the flow drives, the key.

`quantize(policy_frontend, kind, calibration, checkpoint_dir)` runs `flashrt.quant.flow` over the
loaded float model behind an eager frontend of its own (hooks of the observing weights need Python to
run the step), then leaves the quantized weights installed for the frontend the caller captures next.
Which GEMMs are quantized is the recipe's (calibration/pi0.toml). The gate compares the model's raw
actions (normalized units, (H, max_action_dim)) on held-out observations.

Synthetic samples (`synthetic_observations`): uint8 frames of smooth random colour fields plus
noise at the checkpoint's resolution, a state near zero in normalized units, prompts from a fixed
list, flow-matching noise; deterministic in the recipe's seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.frontends.pi0.frontend import Pi0Frontend
from flashrt.frontends.pi0.model import Pi0Model
from flashrt.quant.flow import quantize_family
from flashrt.quant.samples import smooth_frame
from flashrt.runtime.device import device_arch

DEFAULT_RECIPE = "pi0"
PROMPTS = ("pick up the red cube", "put the block in the box", "open the drawer", "fold the towel")


def synthetic_observations(pf: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` observations for the policy frontend ``pf`` (module docstring)."""
    rng = np.random.default_rng(seed)
    side, c = pf.checkpoint.resolution, pf.config
    side = side if isinstance(side, int) else side[0]
    out = []
    for i in range(n):
        images = {cam: smooth_frame(rng, side, side) for cam in pf.cameras}
        out.append({"images": images, "state": rng.normal(0.0, 0.5, pf.state_dim).astype(np.float32),
                    "prompt": PROMPTS[i % len(PROMPTS)],
                    "noise": rng.normal(0.0, 1.0, (c.chunk_size, c.max_action_dim)).astype(np.float32)})
    return out


def runner(pf: Any):
    """sample -> the model's raw actions (H, max_action_dim) float32, through the frontend's verbs."""

    def run(sample: dict[str, Any]) -> torch.Tensor:
        obs = {k: _numpy(v) for k, v in sample.items() if k != "noise"}  # a recorded trace holds tensors
        bucket, checked = pf.check(obs, sample.get("noise"))
        pf.write(bucket, checked)
        pf.replay(bucket)
        return pf.frontend.actions()

    return run


def _numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    return value


def quantize(pf: Any, kind: str, calibration: Any, checkpoint_dir: str | Path) -> dict[str, Any]:
    """Quantize the model behind ``pf`` (an eager `Pi0PolicyFrontend`) in place; returns the flow's
    info. ``calibration``: see `flashrt.quant.flow.Calibration`."""
    c = pf.config
    key_fields = {"config": c, "shapes": {"cameras": list(pf.cameras), "buckets": list(pf.buckets),
                                          "chunk": c.chunk_size, "steps": c.num_steps},
                  "arch": device_arch(pf.device)}
    return quantize_family(pf.frontend.model, kind, calibration, default_recipe=DEFAULT_RECIPE,
                           synthetic=lambda n, seed: synthetic_observations(pf, n, seed), run=runner(pf),
                           key_fields=key_fields, name=f"{c.variant}-{kind}", device=pf.device,
                           checkpoint=checkpoint_dir, on_install=Pi0Model.select_ops)


def calibration_frontend(model: Any, n_cams: int, buckets: tuple[int, ...]) -> Pi0Frontend:
    """An eager frontend over ``model`` for the calibration runs (its own buffers)."""
    frontend = Pi0Frontend(model, n_cams, buckets, "eager")
    frontend.capture()
    return frontend
