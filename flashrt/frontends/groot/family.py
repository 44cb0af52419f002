"""The GROOT registry entry: detect a GR00T N1.7 checkpoint folder, load it as a captured frontend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.groot import checkpoint as ck
from flashrt.frontends.groot.config import n17_config
from flashrt.frontends.groot.frontend import GrootFrontend, Options
from flashrt.frontends.groot.preprocess import ImageSpec, PromptTokenizer
from flashrt.frontends.groot.weights import load_n17
from flashrt.io import open_checkpoint
from flashrt.quant.precision import compute_dtype
from flashrt.runtime.device import resolve_device
from flashrt.runtime.frontend import PolicyFamily
from flashrt.runtime.graphs import backend_for_device

DEFAULT_TARGET, DEFAULT_CROP = (256, 256), (230, 230)  # lerobot's N1_7_DEFAULT_IMAGE_{TARGET,CROP}_SIZE


def _tokenizer_path(folder: Path, backbone_dir: Path | None, tokenizer: str | Path | None) -> Path:
    if tokenizer is not None:
        path = Path(tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    for base in (backbone_dir, folder):
        if base is not None and (base / "tokenizer.json").is_file():
            return base / "tokenizer.json"
    raise CheckpointError(
        f"{folder}: no tokenizer.json next to the checkpoint or its backbone config; pass "
        "tokenizer=PATH (the Cosmos-Reason2 / Qwen3-VL tokenizer.json)"
    )


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
) -> GrootFrontend:
    """A captured GR00T N1.7 frontend for ``folder`` (see `flashrt.frontends.groot.checkpoint`)."""
    folder = Path(folder)
    ck.detect(folder)
    config, bb_dir = n17_config(folder, ck.read_json(folder / "config.json"), num_steps)
    side = ck.Sidecars.read(folder)
    emb = side.embodiment(embodiment, config.head.num_embodiments)
    cams = tuple(cameras) if cameras is not None else emb.cameras
    if not cams:
        raise ConfigError("no cameras: the checkpoint names none for this embodiment; pass cameras=(...)")
    unknown = [c for c in cams if emb.cameras and c not in emb.cameras]
    if unknown or len(set(cams)) != len(cams):
        raise ConfigError(
            f"cameras {list(cams)}: {unknown or 'repeated'}; embodiment {emb.tag!r} was trained "
            f"with {list(emb.cameras)} (in that order; a subset is allowed)"
        )
    kw = side.kwargs
    v = config.vision
    if kw.get("image_target_size") is None:  # lerobot's fallback: the geometry N1.7 was trained on
        kw = {
            **kw,
            "image_target_size": DEFAULT_TARGET,
            "image_crop_size": DEFAULT_CROP,
            "shortest_image_edge": None,
            "crop_fraction": None,
        }
    image = ImageSpec.from_kwargs(
        kw.get("image_target_size"),
        kw.get("image_crop_size"),
        kw.get("shortest_image_edge"),
        kw.get("crop_fraction"),
        v.patch * v.merge,
    )
    if kw.get("use_albumentations") or kw.get("letter_box_transform"):
        raise CheckpointError(
            "processor_config.json: albumentations / letter-box image transforms are not supported yet"
        )
    dev = resolve_device(device)
    with open_checkpoint(folder) as weights:
        model = load_n17(config, weights, dev, compute_dtype(precision))
    opts = Options(bool(kw.get("formalize_language", True)), bool(kw.get("clip_outliers", True)))
    frontend = GrootFrontend(
        model,
        emb,
        cams,
        image,
        PromptTokenizer(_tokenizer_path(folder, bb_dir, tokenizer)),
        opts,
        buckets,
        backend_for_device(backend, dev),
    )
    frontend.capture()
    return frontend


FAMILY = PolicyFamily(
    name="groot",
    detect=lambda folder: ck.detect(Path(folder)),
    load=load,
    options=("embodiment", "cameras", "tokenizer"),
    doc="NVIDIA GR00T N1.7 (Qwen3-VL backbone, AlternateVLDiT flow-matching head)",
)
