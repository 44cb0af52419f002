"""Synthetic calibration inputs shared by the families' recipes (deterministic in the caller's rng)."""

from __future__ import annotations

import numpy as np


def smooth_frame(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols, 3) uint8 camera frame: a 4 x 4 field of random colours, upsampled, plus noise (a
    natural-image-like amax profile, unlike uniform noise)."""
    coarse = rng.uniform(0, 255, (4, 4, 3))
    smooth = np.kron(coarse, np.ones((-(-rows // 4), -(-cols // 4), 1)))[:rows, :cols]
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
