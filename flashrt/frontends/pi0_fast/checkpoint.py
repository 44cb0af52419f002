"""Pi0-FAST checkpoint directories (lerobot 0.6.1 ``pi0_fast`` policy dirs): what a policy needs.

    config.json                 "type": "pi0_fast", chunk_size, n_action_steps, max_decoding_steps,
                                fast_skip_tokens, image_resolution, input/output features, empty_cameras,
                                validate_action_token_prefix, temperature
    model.safetensors           PaliGemma keys under "model." (no expert)
    policy_preprocessor.json    rename_observations, to_batch, relative_actions, normalizer (+ state),
                                pi0_fast_prepare_state_tokenizer_processor_step, tokenizer (max_length),
                                action_tokenizer (training only), device
    policy_postprocessor.json   unnormalizer (+ state), absolute_actions, device
    tokenizer.model             PaliGemma's SentencePiece model (not saved by lerobot: copy it in, or
                                pass tokenizer=), as for Pi0
    fast_tokenizer/             the FAST processor's processor_config.json + tokenizer.json (or pass
                                action_tokenizer=); see `flashrt.frontends.pi0_fast.fast`

openpi's Pi0-FAST is a JAX checkpoint; its PyTorch conversion covers Pi0/Pi0.5 only, so the lerobot
layout is the one read here. Sizes come from the tensors; the config gives the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.checkpoint import (
    ACTION_KEY,
    STATE_KEY,
    _feature_dim,
    _int,
    _lerobot_cameras,
    _open_weights,
    _read_json,
    _relative_mask,
    _shapes,
    _steps,
)
from flashrt.frontends.pi0.normalize import Normalizer, lerobot_normalizer
from flashrt.frontends.pi0.tokenizer import find_tokenizer
from flashrt.frontends.pi0_fast.config import Pi0FastConfig, config_from_shapes
from flashrt.frontends.pi0_fast.fast import find_fast_folder
from flashrt.io import Checkpoint

__all__ = ["Pi0FastCheckpoint", "load_checkpoint", "detect"]

KNOWN_PRE_STEPS = frozenset({
    "rename_observations_processor", "to_batch_processor", "relative_actions_processor",
    "normalizer_processor", "pi0_fast_prepare_state_tokenizer_processor_step", "tokenizer_processor",
    "action_tokenizer_processor", "device_processor"})
KNOWN_POST_STEPS = frozenset({"unnormalizer_processor", "absolute_actions_processor", "device_processor"})
TYPE = "pi0_fast"


@dataclass(frozen=True)
class Pi0FastCheckpoint:
    """Everything read from a Pi0-FAST policy dir; `weights` is the lazy tensor mapping."""

    path: Path
    model_config: Pi0FastConfig
    weights: Checkpoint
    cameras: tuple[str, ...]
    resolution: int
    state_dim: int
    action_dim: int
    chunk_size: int
    n_action_steps: int
    max_prompt_len: int
    state_norm: Normalizer
    action_norm: Normalizer
    tokenizer_path: Path
    fast_path: Path
    check_prefix: bool = True
    temperature: float = 0.0
    relative_mask: tuple[bool, ...] | None = None
    rename_map: Mapping[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "layout": "lerobot", "variant": TYPE, "cameras": list(self.cameras),
                "resolution": self.resolution, "state_dim": self.state_dim, "action_dim": self.action_dim,
                "chunk_size": self.chunk_size, "n_action_steps": self.n_action_steps,
                "max_decoding_steps": self.model_config.max_decoding_steps,
                "max_prompt_len": self.max_prompt_len, "fast_tokenizer": str(self.fast_path),
                "normalization": {"state": self.state_norm.mode, "action": self.action_norm.mode}}


def detect(path: Path) -> None:
    """None for a lerobot pi0_fast policy dir; CheckpointError saying why not otherwise."""
    folder = Path(path)
    config = folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        raise CheckpointError(f"{folder} has no config.json (a Pi0-FAST checkpoint is a lerobot policy dir)")
    kind = _read_json(config).get("type")
    if kind != TYPE:
        raise CheckpointError(f"{config} is a {kind!r} policy, not {TYPE!r}")
    if not (folder / "policy_preprocessor.json").is_file():
        raise CheckpointError(f"{folder} has no policy_preprocessor.json (a lerobot >= 0.4 policy dir keeps "
                              "its normalization there)")


def _bool(cfg: Mapping[str, Any], name: str, default: bool) -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: field {name!r} must be true or false, got {value!r}")
    return value


def _temperature(cfg: Mapping[str, Any]) -> float:
    value = cfg.get("temperature", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e6:
        raise CheckpointError(f"config.json: temperature must be a number >= 0, got {value!r}")
    return float(value)


def _model_config(cfg: Mapping[str, Any], weights: Checkpoint) -> Pi0FastConfig:
    model = config_from_shapes(_shapes(weights),
                               max_decoding_steps=_int(cfg, "max_decoding_steps", "config.json", 256),
                               fast_skip_tokens=_int(cfg, "fast_skip_tokens", "config.json", 128))
    res = tuple(cfg.get("image_resolution", (model.vision.image_size,) * 2))
    if res != (model.vision.image_size,) * 2:
        raise CheckpointError(f"config.json image_resolution {list(res)} differs from the SigLIP position "
                              f"table ({model.vision.image_size} x {model.vision.image_size})")
    return model


def _read(folder: Path, tokenizer: str | Path | None,
          action_tokenizer: str | Path | None) -> Pi0FastCheckpoint:
    cfg = _read_json(folder / "config.json")
    pre = _steps(folder, "policy_preprocessor.json", KNOWN_PRE_STEPS)
    _steps(folder, "policy_postprocessor.json", KNOWN_POST_STEPS)
    for step in ("tokenizer_processor", "pi0_fast_prepare_state_tokenizer_processor_step"):
        if step not in pre:
            raise CheckpointError(f"{folder}/policy_preprocessor.json has no {step} step")
    weights = _open_weights(folder)
    model = _model_config(cfg, weights)
    action_dim = _feature_dim(cfg.get("output_features", {}), ACTION_KEY, "config.json output_features")
    chunk = _int(cfg, "chunk_size", "config.json")
    max_len = _int(pre["tokenizer_processor"].get("config", {}), "max_length",
                   "policy_preprocessor.json tokenizer_processor", 0)
    return Pi0FastCheckpoint(
        path=folder, model_config=model, weights=weights, cameras=_lerobot_cameras(cfg),
        resolution=model.vision.image_size,
        state_dim=_feature_dim(cfg.get("input_features", {}), STATE_KEY, "config.json input_features"),
        action_dim=action_dim, chunk_size=chunk,
        n_action_steps=_int(cfg, "n_action_steps", "config.json", chunk),
        max_prompt_len=max_len or _int(cfg, "tokenizer_max_length", "config.json", 200),
        state_norm=lerobot_normalizer(folder, "policy_preprocessor.json", "normalizer_processor", STATE_KEY),
        action_norm=lerobot_normalizer(folder, "policy_postprocessor.json", "unnormalizer_processor",
                                       ACTION_KEY),
        tokenizer_path=find_tokenizer(tokenizer, [folder]),
        fast_path=find_fast_folder(action_tokenizer, folder),
        check_prefix=_bool(cfg, "validate_action_token_prefix", True), temperature=_temperature(cfg),
        relative_mask=_relative_mask(pre.get("relative_actions_processor"), action_dim),
        rename_map=dict(pre.get("rename_observations_processor", {}).get("config", {}).get("rename_map", {})))


def load_checkpoint(path: str | Path, tokenizer: str | Path | None = None,
                    action_tokenizer: str | Path | None = None) -> Pi0FastCheckpoint:
    """Read a lerobot pi0_fast policy dir (CheckpointError naming the file and field on any problem)."""
    folder = Path(path)
    detect(folder)
    try:
        ck = _read(folder, tokenizer, action_tokenizer)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{folder}: malformed pi0_fast checkpoint metadata "
                              f"({type(exc).__name__}: {exc})") from None
    pairs = (("state", ck.state_norm, ck.state_dim), ("action", ck.action_norm, ck.action_dim))
    for what, norm, dim in pairs:
        if norm.dim is not None and norm.dim != dim:
            raise CheckpointError(f"{folder}: the {what} statistics have {norm.dim} entries but the "
                                  f"checkpoint's {what} size is {dim}")
    if ck.n_action_steps > ck.chunk_size:
        raise CheckpointError(f"{folder}/config.json: n_action_steps {ck.n_action_steps} exceeds chunk_size "
                              f"{ck.chunk_size}")
    return ck
