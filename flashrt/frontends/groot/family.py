"""The GROOT registry entry: detect a GR00T N1.7 (lerobot / Isaac-GR00T), N1.6 (Isaac-GR00T) or N1.5
(lerobot 0.5.1 policy) checkpoint folder, load it as a captured frontend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import ConfigError
from flashrt.frontends.groot.common import checkpoint as ck
from flashrt.frontends.groot.common.frontend import GrootFrontend, LoadOptions
from flashrt.frontends.groot.n17 import frontend as n17_frontend
from flashrt.quant.precision import quantized_kind
from flashrt.runtime.frontend import PolicyFamily


def load(
    folder: str | Path,
    device: str | torch.device = "cpu",
    precision: str | torch.dtype = "float32",
    num_steps: int | None = None,
    backend: str | None = None,
    buckets: Sequence[int] | None = None,
    embodiment: str | int | None = None,
    cameras: Sequence[str] | None = None,
    tokenizer: str | Path | None = None,
    frame_size: Sequence[int] | None = None,
    calibration: Any = None,
    kernels: str = "auto",
) -> GrootFrontend:
    """A captured GR00T N1.7 frontend for ``folder`` (see `flashrt.frontends.groot.common.checkpoint`).

    ``frame_size`` (rows, cols) of the cameras matters only for checkpoints whose image transform keeps
    the aspect ratio (``use_albumentations``): it fixes the token layout (default: square frames).

    ``precision="int8"`` / ``"fp8"`` (N1.7, N1.6, N1.5): the recipe's GEMMs quantized with scales from
    the calibration cache, calibrated and gated on a miss (``calibration``: a recipe name, path, dict or
    `flashrt.quant.flow.Calibration`; recipe calibration/groot.toml;
    `flashrt.frontends.groot.common.quantize`).

    ``kernels`` (the "decoder" ops, `flashrt.ops.decoder`): the text layers' norms, RoPE and SwiGLU
    products; "auto" (default) the fused csrc kernels on a CUDA device where they build, else the ATen
    references, as for Pi0 (the one `flashrt.ops.select` pass at load, ``describe()["ops"]``)."""
    from flashrt.frontends.groot.n15 import frontend as n15_frontend

    if quantized_kind(precision) is None and calibration is not None:
        raise ConfigError(f"calibration= applies to precision 'int8' or 'fp8', not {precision!r}")
    opts = LoadOptions(
        device, precision, num_steps, backend, buckets, embodiment, cameras, tokenizer, frame_size,
        calibration, kernels,
    )
    n15 = n15_frontend.n15_layout(Path(folder))
    if n15 is not None:  # frame_size does not apply: every frame is resized to SigLIP's square
        return n15_frontend.load(n15, opts)
    where = ck.layout(Path(folder))
    folder = where.base
    raw = ck.read_json(folder / "config.json")
    if raw.get("model_type") == ck.N16_MODEL_TYPE:
        from flashrt.frontends.groot.n16 import frontend as n16_frontend

        return n16_frontend.load(folder, opts)
    return n17_frontend.load(where, raw, opts)


def detect(folder: Path) -> None:
    """None for a GR00T checkpoint folder flashrt loads (N1.7 raw or a lerobot policy, Isaac-GR00T N1.6, a
    lerobot 0.5.1 N1.5 policy); CheckpointError saying why not."""
    from flashrt.frontends.groot.n15.frontend import n15_layout

    if n15_layout(Path(folder)) is None:
        ck.layout(folder)


FAMILY = PolicyFamily(
    name="groot",
    detect=lambda folder: detect(Path(folder)),
    load=load,
    options=("embodiment", "cameras", "tokenizer", "frame_size", "calibration", "kernels"),
    doc="NVIDIA GR00T N1.7 (Qwen3-VL backbone) / N1.6 (Eagle 3 VL), AlternateVLDiT flow-matching head; "
    "N1.5 (Eagle 2.5 VL, DiT head)",
)
