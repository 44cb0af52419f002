"""GR00T N1.7 checkpoint folders: detection, sidecar files, embodiments and their statistics.

A folder as Isaac-GR00T publishes N1.7 and lerobot 0.6.1 reads it (``base_model_path``):
``config.json`` (model_type ``Gr00tN1d7``), ``model.safetensors`` (or sharded), and the processor
sidecars ``processor_config.json`` (``processor_kwargs``: image sizes, per-embodiment modality configs,
``use_percentiles``, ``clip_outliers``, ``formalize_language``), ``statistics.json`` (per embodiment tag,
per state/action group: min, max, q01, q99, ...) and ``embodiment_id.json`` (tag → id).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.groot.common.actions import ActionDecoder, build_decoder
from flashrt.frontends.groot.common.preprocess import MinMax
from flashrt.io.files import read_json as read_checked_json

N17_MODEL_TYPE = "Gr00tN1d7"
N16_MODEL_TYPE = "Gr00tN1d6"  # Isaac-GR00T's N1.6 layout (flashrt.frontends.groot.n16.model)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file, capped (flashrt.io.files): never hangs, never a raw error."""
    return read_checked_json(path, "GR00T checkpoint file")


@dataclass(frozen=True)
class Layout:
    """Where an N1.7 checkpoint's parts live. A raw N1.7 folder holds everything; a lerobot policy folder
    (``GrootPolicy.save_pretrained``: config.json of type "groot", model.safetensors with
    ``_groot_model.`` keys) holds the weights and names the raw folder (``base_model_path``, absolute or
    relative to the policy folder) that holds the architecture config and the processor sidecars."""

    weights: Path
    base: Path
    embodiment: str | None = None  # the policy's embodiment_tag


def layout(folder: Path) -> Layout:
    """The `Layout` of an N1.7 checkpoint folder; CheckpointError saying why it is not one."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    cfg = read_json(cfg_path)
    if cfg.get("type") != "groot":
        _check_n17(cfg_path, cfg, n16=True)
    if not any(folder.glob("model*.safetensors")):
        raise CheckpointError(f"{folder}: no model*.safetensors")
    if cfg.get("type") != "groot":
        return Layout(folder, folder)
    base = Path(str(cfg.get("base_model_path") or ""))
    base = base if base.is_absolute() else folder / base
    if not cfg.get("base_model_path") or not (base / "config.json").is_file():
        raise CheckpointError(
            f"{cfg_path}: a lerobot groot policy whose base_model_path {cfg.get('base_model_path')!r} is not "
            "a local GR00T N1.7 folder (download it and point base_model_path at it)"
        )
    _check_n17(base / "config.json")
    return Layout(folder, base, cfg.get("embodiment_tag"))


def _check_n17(path: Path, cfg: dict[str, Any] | None = None, n16: bool = False) -> None:
    """CheckpointError unless ``path`` is an N1.7 config (or, with ``n16``, an Isaac-GR00T N1.6 one)."""
    cfg = read_json(path) if cfg is None else cfg
    if n16 and cfg.get("model_type") == N16_MODEL_TYPE:
        return
    if cfg.get("model_type") == "gr00t_n1_5":
        raise CheckpointError(
            f"{path}: a bare GR00T N1.5 model folder; load the lerobot 0.5.1 groot policy folder whose "
            "base_model_path names it (flashrt.frontends.groot.n15.frontend)"
        )
    if cfg.get("model_type") != N17_MODEL_TYPE:
        raise CheckpointError(
            f"{path}: model_type {cfg.get('model_type')!r} is not {N17_MODEL_TYPE!r} (GR00T "
            f"N1.7) or {N16_MODEL_TYPE!r} (GR00T N1.6) and type is not 'groot' (a lerobot policy)"
        )


@dataclass(frozen=True)
class Embodiment:
    """One embodiment tag of the checkpoint: its id, cameras, state/action statistics and sizes."""

    tag: str
    id: int
    cameras: tuple[str, ...]
    state: MinMax
    actions: ActionDecoder
    horizon: int | None = None  # len(action delta_indices): the actions decoded per chunk
    frames: int = 1  # len(video delta_indices): each camera's current frame is fed this many times

    @property
    def replan_period(self) -> int | None:
        """lerobot's execution horizon: the decoded chunk, except 8 for ``libero_sim`` (NVIDIA's LIBERO
        rollout wrapper replans after 8 of its 16 actions)."""
        if self.horizon is None:
            return None
        return min(self.horizon, 8) if self.tag == "libero_sim" else self.horizon

    @property
    def state_dim(self) -> int:
        return int(self.state.low.shape[0])

    @property
    def action_dim(self) -> int:
        return self.actions.dim


@dataclass(frozen=True)
class Sidecars:
    kwargs: dict[str, Any]
    stats: dict[str, Any]
    ids: dict[str, int]

    @classmethod
    def read(cls, folder: Path) -> Sidecars:
        kwargs = read_json(folder / "processor_config.json").get("processor_kwargs", {})
        ids = {str(k): int(v) for k, v in read_json(folder / "embodiment_id.json").items()}
        return cls(kwargs, read_json(folder / "statistics.json"), ids)

    def tags(self) -> list[str]:
        return sorted(set(self.stats) & set(self.kwargs.get("modality_configs", {})))

    def embodiment(self, choice: str | int | None, num_embodiments: int) -> Embodiment:
        """The embodiment named by tag or id (None: the only one); ConfigError naming the choices."""
        tags = self.tags()
        if choice is None and len(tags) == 1:
            choice = tags[0]
        if isinstance(choice, int) and not isinstance(choice, bool):
            by_id = [t for t in tags if self.ids.get(t) == choice]
            choice = by_id[0] if by_id else choice
        if choice not in tags:
            known = ", ".join(f"{t} (id {self.ids.get(t)})" for t in tags)
            raise ConfigError(f"embodiment {choice!r} is not in this checkpoint; choose one of: {known}")
        if choice not in self.ids or not 0 <= self.ids[choice] < num_embodiments:
            raise CheckpointError(
                f"embodiment_id.json: {choice!r} has no id below max_num_embodiments {num_embodiments}"
            )
        return self._build(str(choice))

    def _build(self, tag: str) -> Embodiment:
        cfg = self.kwargs["modality_configs"][tag]
        cams = tuple(cfg.get("video", {}).get("modality_keys", []))
        horizon = len(cfg.get("action", {}).get("delta_indices") or []) or None
        decoder = build_decoder(
            tag,
            self.stats[tag],
            cfg,
            self._state_slices(tag, cfg),
            bool(self.kwargs.get("use_percentiles", False)),
            bool(self.kwargs.get("use_relative_action", False)),
        )
        frames = len(cfg.get("video", {}).get("delta_indices") or [0])
        return Embodiment(tag, self.ids[tag], cams, self._minmax(tag, "state", cfg), decoder, horizon, frames)

    def _state_slices(self, tag: str, cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """Raw-state columns of each state group (widths from its statistics, as lerobot splits them)."""
        out, start = {}, 0
        for key in cfg.get("state", {}).get("modality_keys", []):
            entry = self.stats[tag].get("state", {}).get(key) or {}
            width = len(entry.get("mean") or entry.get("min") or entry.get("q01") or [])
            out[key] = (start, start + width)
            start += width
        return out

    def _minmax(self, tag: str, modality: str, cfg: dict[str, Any]) -> MinMax:
        pct = bool(self.kwargs.get("use_percentiles", False))
        lo_name, hi_name = ("q01", "q99") if pct else ("min", "max")
        lows, highs = [], []
        for key in cfg.get(modality, {}).get("modality_keys", []):
            entry = self.stats[tag].get(modality, {}).get(key)
            if not isinstance(entry, dict) or lo_name not in entry or hi_name not in entry:
                raise CheckpointError(f"statistics.json: {tag}.{modality}.{key} has no {lo_name}/{hi_name}")
            lows += list(entry[lo_name])
            highs += list(entry[hi_name])
        if not lows:
            raise CheckpointError(f"statistics.json: no {modality} statistics for embodiment {tag!r}")
        return MinMax(np.asarray(lows, np.float32), np.asarray(highs, np.float32))
