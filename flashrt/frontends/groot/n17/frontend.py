"""GR00T N1.7's frontend: the checkpoint's camera transform and tokenizer, and the captured
`GrootFrontend` (the shared base, which is N1.7's own step) around its loaded `GrootN17Model`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.groot.common import checkpoint as ck
from flashrt.frontends.groot.common.config import n17_config
from flashrt.frontends.groot.common.frontend import GrootFrontend, LoadOptions, Options, finish, load_model
from flashrt.frontends.groot.common.preprocess import ImageSpec, PromptTokenizer
from flashrt.frontends.groot.n17.weights import load_n17
from flashrt.runtime.graphs import backend_for_device

DEFAULT_TARGET, DEFAULT_CROP = (256, 256), (230, 230)  # lerobot's N1_7_DEFAULT_IMAGE_{TARGET,CROP}_SIZE


def _processor_sizes(bb_dir: Path | None) -> dict[str, Any]:
    """min/max pixels and mean/std of the backbone's image processor (its preprocessor_config.json when
    the backbone is a local folder; Qwen3-VL's defaults otherwise)."""
    path = bb_dir / "preprocessor_config.json" if bb_dir is not None else None
    if path is None or not path.is_file():
        return {}
    cfg = ck.read_json(path)
    size = cfg.get("size") or {}
    out = {
        "min_pixels": cfg.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": cfg.get("max_pixels", size.get("longest_edge")),
        "mean": tuple(cfg["image_mean"]) if cfg.get("image_mean") else None,
        "std": tuple(cfg["image_std"]) if cfg.get("image_std") else None,
    }
    return {k: v for k, v in out.items() if v is not None}


def image_spec(kw: dict[str, Any], factor: int, bb_dir: Path | None) -> ImageSpec:
    """The camera transform the checkpoint's processor_config.json asks for (lerobot's fallback geometry,
    256 px with a 230 px crop, when it names none)."""
    if kw.get("letter_box_transform"):
        raise CheckpointError("processor_config.json: the letter-box image transform is not supported yet")
    if kw.get("image_target_size") is None:
        kw = {
            **kw,
            "image_target_size": DEFAULT_TARGET,
            "image_crop_size": DEFAULT_CROP,
            "shortest_image_edge": None,
            "crop_fraction": None,
        }
    mode = "albumentations" if kw.get("use_albumentations") else "torch"
    return ImageSpec.from_kwargs(
        kw.get("image_target_size"),
        kw.get("image_crop_size"),
        kw.get("shortest_image_edge"),
        kw.get("crop_fraction"),
        factor,
        mode=mode,
        **_processor_sizes(bb_dir),
    )


def _tokenizer_path(folder: Path, backbone_dir: Path | None, tokenizer: str | Path | None) -> Path:
    if tokenizer is not None:
        path = Path(tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    for base in (backbone_dir, folder):
        if base is not None and (base / "tokenizer.json").is_file():
            return base / "tokenizer.json"
    raise CheckpointError(
        f"{folder}: no tokenizer.json next to the checkpoint or its backbone config; pass "
        "tokenizer=PATH (CLI: --tokenizer PATH; the Cosmos-Reason2 / Qwen3-VL tokenizer.json)"
    )


def load(where: ck.Layout, raw: dict[str, Any], opts: LoadOptions) -> GrootFrontend:
    """The captured N1.7 frontend for a checkpoint `flashrt.frontends.groot.family.load` found to be
    N1.7 (``where``, its ``config.json`` as ``raw``)."""
    folder, embodiment, cameras = where.base, opts.embodiment, opts.cameras
    config, bb_dir = n17_config(folder, raw, opts.num_steps)
    side = ck.Sidecars.read(folder)
    emb = side.embodiment(
        embodiment if embodiment is not None else where.embodiment, config.head.num_embodiments
    )
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
    image = image_spec(kw, config.vision.patch * config.vision.merge, bb_dir)
    model, dev = load_model(load_n17, config, where.weights, opts)
    frame_size = opts.frame_size
    frontend = GrootFrontend(
        model,
        emb,
        cams,
        image,
        PromptTokenizer(_tokenizer_path(folder, bb_dir, opts.tokenizer)),
        Options.from_kwargs(kw),
        opts.buckets,
        backend_for_device(opts.backend, dev),
        tuple(int(x) for x in frame_size) if frame_size is not None else None,
    )
    return finish(frontend, opts, folder)
