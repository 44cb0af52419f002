"""The GROOT registry entry: detect a GR00T N1.7 (lerobot / Isaac-GR00T), N1.6 (Isaac-GR00T) or N1.5
(lerobot 0.5.1 policy) checkpoint folder, load it as a captured frontend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.groot import checkpoint as ck
from flashrt.frontends.groot.config import n17_config
from flashrt.frontends.groot.frontend import GrootFrontend, LoadOptions, Options, finish, load_model
from flashrt.frontends.groot.preprocess import ImageSpec, PromptTokenizer
from flashrt.frontends.groot.weights import load_n17
from flashrt.quant.precision import quantized_kind
from flashrt.runtime.frontend import PolicyFamily
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
    """A captured GR00T N1.7 frontend for ``folder`` (see `flashrt.frontends.groot.checkpoint`).

    ``frame_size`` (rows, cols) of the cameras matters only for checkpoints whose image transform keeps
    the aspect ratio (``use_albumentations``): it fixes the token layout (default: square frames).

    ``precision="int8"`` / ``"fp8"`` (N1.7, N1.6, N1.5): the recipe's GEMMs quantized with scales from
    the calibration cache, calibrated and gated on a miss (``calibration``: a recipe name, path, dict or
    `flashrt.quant.flow.Calibration`; recipe calibration/groot.toml; `flashrt.frontends.groot.quantize`).

    ``kernels`` (the "decoder" ops, `flashrt.ops.decoder`): the text layers' norms, RoPE and SwiGLU
    products; "auto" (default) the fused csrc kernels on a CUDA device where they build, else the ATen
    references, as for Pi0 (the one `flashrt.ops.select` pass at load, ``describe()["ops"]``)."""
    from flashrt.frontends.groot import n15_frontend

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
        from flashrt.frontends.groot import n16_frontend

        return n16_frontend.load(folder, opts)
    return _load_n17(where, raw, opts)


def _load_n17(where: ck.Layout, raw: dict[str, Any], opts: LoadOptions) -> GrootFrontend:
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


FAMILY = PolicyFamily(
    name="groot",
    detect=lambda folder: ck.detect(Path(folder)),
    load=load,
    options=("embodiment", "cameras", "tokenizer", "frame_size", "calibration", "kernels"),
    doc="NVIDIA GR00T N1.7 (Qwen3-VL backbone) / N1.6 (Eagle 3 VL), AlternateVLDiT flow-matching head; "
    "N1.5 (Eagle 2.5 VL, DiT head)",
)
