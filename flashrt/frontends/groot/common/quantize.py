"""GR00T in int8 (W8A8) or fp8: calibration samples, the eager run the flow drives, the cache key.

`quantize(frontend, kind, calibration, folder)` runs `flashrt.quant.flow` over a constructed,
not yet captured `GrootFrontend` (N1.7, N1.6 or N1.5): each sample goes through the frontend's own
checks and buffers, then its step runs eagerly (the observing weights' hooks need Python), and the
quantized weights stay installed for the capture that follows. Which GEMMs are quantized is the
recipe's (calibration/groot.toml). The gate compares the head's normalized action chunk on held-out
observations. ``calibration={"data": [...]}`` takes recorded samples instead: the inputs of a
`flashrt bench groot-* --save-trace` trace ({"obs": observation, "noise": array}) or observations.

Synthetic samples (`synthetic_observations`): per camera a uint8 frame of the size the frontend was
loaded for (smooth random colour fields plus noise), a raw state drawn in [-1, 1], prompts from a
fixed list, flow-matching noise; deterministic in the recipe's seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.quant.flow import quantize_family
from flashrt.quant.samples import smooth_frame
from flashrt.runtime.device import device_arch

DEFAULT_RECIPE = "groot"
PROMPTS = ("pick up the apple", "open the drawer", "put the cup on the plate", "fold the towel")


def synthetic_observations(fe: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` observations for the frontend ``fe`` (module docstring)."""
    rng = np.random.default_rng(seed)
    rows, cols = fe.frame_shape
    noise_shape = fe.buffers.spec("expert_noise").shape
    return [{"images": {cam: smooth_frame(rng, rows, cols) for cam in fe.cameras},
             "state": rng.uniform(-1.0, 1.0, fe.state_size).astype(np.float32),
             "prompt": PROMPTS[i % len(PROMPTS)],
             "noise": rng.standard_normal(noise_shape).astype(np.float32)} for i in range(n)]


def runner(fe: Any):
    """sample -> the head's normalized action chunk, through the frontend's checks and buffers, its step
    run eagerly (one step function per bucket, built on first use)."""
    steps: dict[int, Any] = {}

    def run(sample: dict[str, Any]) -> torch.Tensor:
        # a synthetic sample (observation keys + "noise") or a recorded bench input ({"obs", "noise"})
        obs = sample["obs"] if "obs" in sample else {k: v for k, v in sample.items() if k != "noise"}
        bucket, checked = fe.check(obs, sample.get("noise"))
        fe.write(bucket, checked)
        if bucket not in steps:
            steps[bucket] = fe._build(bucket)
        steps[bucket]()
        return fe.buffers["expert_actions"][0, : fe.chunk_size].float().clone()

    return run


def quantize(fe: Any, kind: str, calibration: Any, folder: str | Path | None,
             weights_digest: str | None = None) -> dict[str, Any]:
    """Quantize the model behind ``fe`` in place; returns the flow's info (`Pi0`'s counterpart). The
    cache key digests the checkpoint ``folder``, or takes ``weights_digest`` (weights with no file:
    the random-weight benchmarks)."""
    describe = fe.describe()
    key_fields = {"config": fe.config,
                  "shapes": {"cameras": list(fe.cameras), "buckets": list(fe.buckets),
                             "image_size": list(fe.image_size), "embodiment": describe.get("embodiment"),
                             "chunk": fe.chunk_size},
                  "arch": device_arch(fe.device)}
    return quantize_family(fe.model, kind, calibration, default_recipe=DEFAULT_RECIPE,
                           synthetic=lambda n, seed: synthetic_observations(fe, n, seed), run=runner(fe),
                           key_fields=key_fields, name=f"groot-{describe.get('version', '')}-{kind}",
                           device=fe.device, checkpoint=folder, weights_digest=weights_digest)
