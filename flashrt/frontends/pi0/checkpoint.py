"""Pi0 / Pi0.5 checkpoint directories: detect the layout, read everything a policy needs.

Layouts (registry `LAYOUTS`, tried in order; each has a `detect(dir)` and a `read(dir, ...)`):

lerobot 0.6.1 policy dir (`policy.save_pretrained` + the processors' `save_pretrained`)::

    config.json                 "type": "pi0" | "pi05", chunk_size, n_action_steps, num_inference_steps,
                                image_resolution, max_state_dim, max_action_dim, tokenizer_max_length,
                                input_features (cameras observation.images.<name>, observation.state),
                                output_features (action), empty_cameras
    model.safetensors           keys under "model."
    policy_preprocessor.json    steps: rename_observations, to_batch, [pi0_new_line], tokenizer, device,
                                relative_actions, normalizer (+ its state file),
                                [pi05_prepare_state_tokenizer]
    policy_postprocessor.json   steps: unnormalizer (+ state file), absolute_actions, device

openpi PyTorch dir (`examples/convert_jax_model_to_pytorch.py`)::

    model.safetensors           the same keys without "model."
    config.json                 action_dim, action_horizon, paligemma_variant, action_expert_variant
    assets/<asset_id>/norm_stats.json

openpi fixes what lerobot stores in its config: three camera slots (`base_0_rgb`, `left_wrist_0_rgb`,
`right_wrist_0_rgb`), 10 denoising steps, a prompt of at most 48 (Pi0) / 200 (Pi0.5) tokens, mean/std
normalization for Pi0 and quantiles for Pi0.5, state and action sizes = the sizes of its statistics.

Model sizes always come from the tensor shapes (`config_from_state_dict_shapes`); the config files give
what the tensors cannot (chunk size, steps, cameras, normalization, prompt format).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.config import Pi0Config, config_from_state_dict_shapes
from flashrt.frontends.pi0.normalize import Normalizer, lerobot_normalizer, openpi_normalizers
from flashrt.frontends.pi0.preprocess import CAMERA_PREFIX, camera_name
from flashrt.frontends.pi0.tokenizer import find_tokenizer
from flashrt.frontends.pi0.weights import detect_variant
from flashrt.io import Checkpoint, open_checkpoint
from flashrt.io.files import read_json, resolve_inside

OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
OPENPI_MAX_TOKENS = {"pi0": 48, "pi05": 200}
OPENPI_STEPS = 10
OPENPI_CHUNK = 50
STATE_KEY, ACTION_KEY = "observation.state", "action"

# Preprocessor steps flashrt reproduces (anything else in a lerobot pipeline is refused, not skipped).
KNOWN_PRE_STEPS = frozenset({
    "rename_observations_processor", "to_batch_processor", "pi0_new_line_processor", "tokenizer_processor",
    "device_processor", "relative_actions_processor", "normalizer_processor",
    "pi05_prepare_state_tokenizer_processor_step"})
KNOWN_POST_STEPS = frozenset({"unnormalizer_processor", "absolute_actions_processor", "device_processor"})


@dataclass(frozen=True)
class Pi0Checkpoint:
    """Everything read from a checkpoint directory; `weights` is the lazy tensor mapping.

    cameras           camera names in slot order (missing ones are masked at run time)
    prompt_format     a `flashrt.frontends.pi0.tokenizer.PROMPT_FORMATS` key
    max_prompt_len    the reference tokenizer's max length (the default largest prompt bucket)
    relative_mask     per action dim, whether the action is relative to the raw state (None: absolute)
    rename_map        lerobot observation-key renames applied before anything else
    """

    path: Path
    layout: str
    model_config: Pi0Config
    weights: Checkpoint
    cameras: tuple[str, ...]
    state_dim: int
    action_dim: int
    n_action_steps: int
    max_prompt_len: int
    prompt_format: str
    state_norm: Normalizer
    action_norm: Normalizer
    tokenizer_path: Path
    relative_mask: tuple[bool, ...] | None = None
    rename_map: Mapping[str, str] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.model_config.variant

    @property
    def resolution(self) -> int:
        return self.model_config.vision.image_size

    def summary(self) -> dict[str, Any]:
        c = self.model_config
        return {"path": str(self.path), "layout": self.layout, "variant": c.variant,
                "cameras": list(self.cameras), "resolution": self.resolution, "state_dim": self.state_dim,
                "action_dim": self.action_dim, "chunk_size": c.chunk_size, "num_steps": c.num_steps,
                "n_action_steps": self.n_action_steps, "max_prompt_len": self.max_prompt_len,
                "normalization": {"state": self.state_norm.mode, "action": self.action_norm.mode}}


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, "checkpoint metadata")


# Limits a checkpoint's config may set: beyond them it is refused at load, never discovered later as a
# multi-GB allocation. PaliGemma's positions end at 8192; no released Pi0 uses chunks or steps near these.
LIMITS = {"chunk_size": 1024, "n_action_steps": 1024, "num_inference_steps": 1000, "max_length": 8192,
          "tokenizer_max_length": 8192, "action_horizon": 1024, "empty_cameras": 16}


def _int(table: Mapping[str, Any], name: str, source: str, default: Any = ...) -> int:
    """A positive int field (bools refused) within `LIMITS`; CheckpointError naming file and field."""
    if not isinstance(table, Mapping) or name not in table:
        if default is ...:
            raise CheckpointError(f"{source}: field {name!r} is missing")
        return default
    value = table[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{source}: field {name!r} must be a non-negative int, got {value!r}")
    if value > LIMITS.get(name, 2**31):
        raise CheckpointError(f"{source}: field {name!r} = {value} exceeds flashrt's limit "
                              f"{LIMITS.get(name)}; is the file corrupt?")
    return value


def _shapes(weights: Checkpoint) -> dict[str, tuple[int, ...]]:
    return {k: tuple(weights.shape(k)) for k in weights}


def _open_weights(folder: Path) -> Checkpoint:
    path = folder / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no model.safetensors")
    return open_checkpoint(path)


# ------------------------------------------------------------------------------------------ lerobot
def _detect_lerobot(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file() or not (folder / "policy_preprocessor.json").is_file():
        return False
    return _read_json(config).get("type") in ("pi0", "pi05")


def _positive(value: int, field: str) -> int:
    if value <= 0:
        raise CheckpointError(f"{field} must be positive, got {value}")
    return value


def _feature_dim(features: Mapping[str, Any], key: str, where: str) -> int:
    if not isinstance(features, Mapping) or key not in features:
        raise CheckpointError(f"{where} has no {key!r} feature")
    shape = features[key].get("shape") if isinstance(features[key], Mapping) else None
    if not isinstance(shape, list) or len(shape) != 1 or isinstance(shape[0], bool) \
            or not isinstance(shape[0], int) or shape[0] <= 0:
        raise CheckpointError(f"{where} {key!r}: shape must be [size] with a positive int, got {shape!r}")
    return shape[0]


def _lerobot_cameras(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    visual = [k for k, f in cfg.get("input_features", {}).items() if f.get("type") == "VISUAL"]
    for i in range(_int(cfg, "empty_cameras", "config.json", 0)):
        key = f"{CAMERA_PREFIX}empty_camera_{i}"
        if key not in visual:
            visual.append(key)
    if not visual:
        raise CheckpointError("config.json declares no VISUAL input feature (camera)")
    return tuple(camera_name(k) for k in visual)


def _steps(folder: Path, name: str, known: frozenset[str]) -> dict[str, dict[str, Any]]:
    pipeline = _read_json(folder / name)
    steps = {s.get("registry_name"): s for s in pipeline.get("steps", [])}
    unknown = sorted(str(s) for s in set(steps) - known)
    if unknown:
        raise CheckpointError(f"{folder / name} has processor step(s) {unknown} that flashrt does not "
                              f"implement (known: {sorted(known)}); refusing rather than skipping them")
    return steps


def _relative_mask(step: Mapping[str, Any] | None, action_dim: int) -> tuple[bool, ...] | None:
    """lerobot `RelativeActionsProcessorStep._build_mask`: dims whose name contains an excluded joint
    stay absolute; without names every dim is relative."""
    config = (step or {}).get("config", {})
    if not config.get("enabled", False):
        return None
    names = config.get("action_names")
    excluded = [str(j).lower() for j in config.get("exclude_joints") or [] if j]
    if not names or not excluded:
        return (True,) * action_dim
    mask = [not any(t in str(n).lower() for t in excluded) for n in names[:action_dim]]
    return tuple(mask + [True] * (action_dim - len(mask)))


def _lerobot_prompt(variant: str, pre: Mapping[str, Any]) -> tuple[str, int]:
    if "tokenizer_processor" not in pre:
        raise CheckpointError("policy_preprocessor.json has no tokenizer_processor step")
    max_len = _int(pre["tokenizer_processor"].get("config", {}), "max_length",
                   "policy_preprocessor.json tokenizer_processor", 0)
    if variant == "pi05":
        if "pi05_prepare_state_tokenizer_processor_step" not in pre:
            raise CheckpointError("a pi05 preprocessor needs pi05_prepare_state_tokenizer_processor_step")
        return "pi05", max_len
    return ("lerobot_pi0" if "pi0_new_line_processor" in pre else "lerobot_plain"), max_len


def _lerobot_model_config(cfg: Mapping[str, Any], weights: Checkpoint, variant: str) -> Pi0Config:
    extra = dict(chunk_size=_int(cfg, "chunk_size", "config.json"),
                 num_steps=_int(cfg, "num_inference_steps", "config.json"),
                 min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)))
    if variant == "pi05" and "max_state_dim" in cfg:  # unused by the Pi0.5 network; kept for the record
        extra["max_state_dim"] = int(cfg["max_state_dim"])
    model = config_from_state_dict_shapes(_shapes(weights), variant, **extra)
    res = tuple(cfg.get("image_resolution", (model.vision.image_size,) * 2))
    if res != (model.vision.image_size,) * 2:
        raise CheckpointError(f"config.json image_resolution {list(res)} differs from the SigLIP position "
                              f"table ({model.vision.image_size} x {model.vision.image_size})")
    for name in ("max_state_dim", "max_action_dim"):
        if name in cfg and getattr(model, name) != int(cfg[name]):
            raise CheckpointError(f"config.json {name} {cfg[name]} differs from the weights "
                                  f"({getattr(model, name)})")
    return model


def _read_lerobot(folder: Path, tokenizer: str | Path | None, **_: Any) -> Pi0Checkpoint:
    cfg = _read_json(folder / "config.json")
    variant = cfg.get("type")
    if variant not in ("pi0", "pi05"):
        raise CheckpointError(f"{folder}/config.json is a {variant!r} policy, not pi0 / pi05")
    pre = _steps(folder, "policy_preprocessor.json", KNOWN_PRE_STEPS)
    _steps(folder, "policy_postprocessor.json", KNOWN_POST_STEPS)
    weights = _open_weights(folder)
    model = _lerobot_model_config(cfg, weights, variant)
    action_dim = _feature_dim(cfg.get("output_features", {}), ACTION_KEY, "config.json output_features")
    prompt_format, max_len = _lerobot_prompt(variant, pre)
    return Pi0Checkpoint(
        path=folder, layout="lerobot", model_config=model, weights=weights, cameras=_lerobot_cameras(cfg),
        state_dim=_feature_dim(cfg.get("input_features", {}), STATE_KEY, "config.json input_features"),
        action_dim=action_dim, n_action_steps=_positive(_int(cfg, "n_action_steps", "config.json",
                                                             model.chunk_size), "n_action_steps"),
        max_prompt_len=_positive(max_len or _int(cfg, "tokenizer_max_length", "config.json", 48),
                                 "tokenizer max_length / tokenizer_max_length"),
        prompt_format=prompt_format,
        state_norm=lerobot_normalizer(folder, "policy_preprocessor.json", "normalizer_processor", STATE_KEY),
        action_norm=lerobot_normalizer(folder, "policy_postprocessor.json", "unnormalizer_processor",
                                       ACTION_KEY),
        tokenizer_path=find_tokenizer(tokenizer, [folder]),
        relative_mask=_relative_mask(pre.get("relative_actions_processor"), action_dim),
        rename_map=dict(pre.get("rename_observations_processor", {}).get("config", {}).get("rename_map", {})))


# ------------------------------------------------------------------------------------------ openpi
def _norm_stats_files(folder: Path) -> list[Path]:
    return sorted((folder / "assets").glob("*/norm_stats.json"))


def _detect_openpi(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and bool(_norm_stats_files(folder))


def _pick_norm_stats(folder: Path, asset_id: str | None) -> Path:
    files = _norm_stats_files(folder)
    if asset_id is not None:
        path = resolve_inside(folder / "assets", f"{asset_id}/norm_stats.json", "asset_id")
        if not path.is_file():
            raise CheckpointError(f"no {path}; asset ids here: {[f.parent.name for f in files]}")
        return path
    if len(files) > 1:
        ids = [f.parent.name for f in files]
        raise CheckpointError(f"{folder}/assets holds several norm_stats.json ({ids}); pick one: asset_id=")
    return files[0]


def _read_openpi(folder: Path, tokenizer: str | Path | None, asset_id: str | None = None,
                 **_: Any) -> Pi0Checkpoint:
    weights = _open_weights(folder)
    variant = detect_variant(weights.keys())
    cfg = _read_json(folder / "config.json") if (folder / "config.json").exists() else {}
    chunk = _int(cfg, "action_horizon", "config.json", OPENPI_CHUNK)
    model = config_from_state_dict_shapes(_shapes(weights), variant, chunk_size=chunk,
                                          num_steps=OPENPI_STEPS)
    if "action_dim" in cfg and int(cfg["action_dim"]) != model.max_action_dim:
        raise CheckpointError(f"config.json action_dim {cfg['action_dim']} differs from the weights "
                              f"({model.max_action_dim})")
    stats = _pick_norm_stats(folder, asset_id)
    state_norm, action_norm = openpi_normalizers(stats, quantiles=variant == "pi05")
    return Pi0Checkpoint(
        path=folder, layout="openpi", model_config=model, weights=weights, cameras=OPENPI_CAMERAS,
        state_dim=state_norm.dim, action_dim=action_norm.dim, n_action_steps=chunk,
        max_prompt_len=OPENPI_MAX_TOKENS[variant],
        prompt_format="pi05" if variant == "pi05" else "openpi_pi0",
        state_norm=state_norm, action_norm=action_norm, tokenizer_path=find_tokenizer(tokenizer, [folder]))


@dataclass(frozen=True)
class Layout:
    """A checkpoint layout: how to recognise its directory and how to read it."""

    name: str
    detect: Callable[[Path], bool]
    read: Callable[..., Pi0Checkpoint]


LAYOUTS: tuple[Layout, ...] = (Layout("lerobot", _detect_lerobot, _read_lerobot),
                               Layout("openpi", _detect_openpi, _read_openpi))


def detect_layout(path: str | Path) -> str:
    """The name of the layout `path` holds ("lerobot" or "openpi"); CheckpointError if none fits."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory (a Pi0 checkpoint is a lerobot policy dir or an "
                              "openpi PyTorch dir)")
    for layout in LAYOUTS:
        if layout.detect(folder):
            return layout.name
    config = folder / "config.json"
    kind = _read_json(config).get("type") if config.is_file() else None
    if kind is not None and kind not in ("pi0", "pi05"):
        raise CheckpointError(f"{config} is a lerobot {kind!r} policy, not pi0 / pi05")
    if kind in ("pi0", "pi05"):
        raise CheckpointError(f"{folder} is a lerobot pi0/pi05 dir without policy_preprocessor.json: a "
                              "policy saved before lerobot 0.4 keeps its normalization inside "
                              "model.safetensors; convert it with lerobot's "
                              "processor/migrate_policy_normalization.py first")
    found = sorted(p.name for p in folder.iterdir())[:20]
    raise CheckpointError(f"{folder} is neither a lerobot policy dir (config.json + policy_preprocessor.json)"
                          f" nor an openpi dir (model.safetensors + assets/*/norm_stats.json); found {found}")


def load_checkpoint(path: str | Path, tokenizer: str | Path | None = None, asset_id: str | None = None,
                    layout: str | None = None) -> Pi0Checkpoint:
    """Read a Pi0 / Pi0.5 checkpoint directory (layout auto-detected unless given)."""
    folder = Path(path)
    name = layout or detect_layout(folder)
    by_name = {lay.name: lay for lay in LAYOUTS}
    if name not in by_name:
        raise CheckpointError(f"unknown layout {name!r}; known: {sorted(by_name)}")
    try:
        ck = by_name[name].read(folder, tokenizer=tokenizer, asset_id=asset_id)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:
        # the last net under the field checks above: malformed metadata is never a raw Python error
        raise CheckpointError(f"{folder}: malformed {name} checkpoint metadata "
                              f"({type(exc).__name__}: {exc})") from None
    _check_statistics_sizes(ck)
    return ck


def _check_statistics_sizes(ck: Pi0Checkpoint) -> None:
    """The statistics describe the configured state / action sizes (never broadcast at run time)."""
    pairs = (("state", ck.state_norm, ck.state_dim), ("action", ck.action_norm, ck.action_dim))
    for what, norm, dim in pairs:
        if norm.dim is not None and norm.dim != dim:
            raise CheckpointError(f"{ck.path}: the {what} statistics have {norm.dim} entries but the "
                                  f"checkpoint's {what} size is {dim}")


def relative_offset(mask: Sequence[bool], state: torch.Tensor, action_dim: int) -> torch.Tensor:
    """The (action_dim,) offset lerobot's AbsoluteActionsProcessorStep adds: raw state where relative."""
    out = torch.zeros(action_dim, dtype=torch.float32)
    n = min(action_dim, state.numel(), len(mask))
    out[:n] = state[:n].float() * torch.tensor(mask[:n], dtype=torch.float32)
    return out
