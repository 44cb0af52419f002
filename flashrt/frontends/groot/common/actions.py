"""GR00T N1.7 action decoding: the normalized model chunk -> the robot's actions, group by group.

As lerobot 0.6.1's ``GrootN17ActionDecodeStep`` does it. The checkpoint's action modality lists groups
(``modality_keys`` with one ``action_configs`` entry each); a group's width comes from its absolute
action statistics. Each group is un-normalized with min/max: ``(clip(a, -1, 1) + 1) / 2 (max - min) +
min``, where min/max are q01/q99 under ``use_percentiles``, and for a RELATIVE group (with
``use_relative_action``) the ``relative_action`` statistics' min/max, which may hold one row per chunk
step. A relative group is then made absolute against the raw (un-normalized) state group named by its
``state_key`` (default: its own key):

    non_eef                      action + reference state
    eef, format "xyz+rot6d"      reference pose @ relative pose (4 x 4 homogeneous, float64), where the
                                 6-D rotation is the first two rows of the rotation matrix, completed
                                 by Gram-Schmidt and a cross product

``libero_sim`` adds the LIBERO gripper convention: the scalar ``gripper`` group becomes
``-sign(2 g - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flashrt.errors import CheckpointError

RELATIVE_KINDS = ("non_eef", "eef_xyz_rot6d")


@dataclass(frozen=True)
class ActionGroup:
    key: str
    start: int  # first column in the model's (and the decoded) action vector
    dim: int
    low: np.ndarray  # (dim,) or (steps, dim)
    high: np.ndarray
    relative: str | None = None  # one of RELATIVE_KINDS
    reference: tuple[int, int] | None = None  # raw-state columns of the reference

    def unnormalize(self, a: np.ndarray) -> np.ndarray:
        """a (T, dim) float32 -> (T, dim) float32 (per-step statistics sliced to T rows)."""
        lo, hi = (
            (self.low[: a.shape[0]], self.high[: a.shape[0]]) if self.low.ndim == 2 else (self.low, self.high)
        )
        return ((np.clip(a, -1.0, 1.0) + 1.0) * 0.5 * (hi - lo) + lo).astype(np.float32)


def rot6d_to_matrix(r6: np.ndarray) -> np.ndarray:
    """(..., 6) -> (..., 3, 3) rows: normalized first row, second row orthogonalized, their cross product."""
    rows = r6.reshape(*r6.shape[:-1], 2, 3).astype(np.float64)
    a = rows[..., 0, :] / np.linalg.norm(rows[..., 0, :], axis=-1, keepdims=True)
    b = rows[..., 1, :] - np.sum(a * rows[..., 1, :], axis=-1, keepdims=True) * a
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.stack([a, b, np.cross(a, b)], axis=-2)


def pose(xyz_rot6d: np.ndarray) -> np.ndarray:
    """(..., 9) -> (..., 4, 4) homogeneous transforms."""
    out = np.zeros((*xyz_rot6d.shape[:-1], 4, 4))
    out[..., :3, :3] = rot6d_to_matrix(xyz_rot6d[..., 3:])
    out[..., :3, 3] = xyz_rot6d[..., :3]
    out[..., 3, 3] = 1.0
    return out


def relative_eef_to_absolute(actions: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """actions (T, 9) relative xyz+rot6d, reference (9,) -> (T, 9) absolute, float32."""
    composed = pose(reference)[None] @ pose(actions)  # (T, 4, 4)
    flat = np.concatenate([composed[:, :3, 3], composed[:, :2, :3].reshape(-1, 6)], axis=-1)
    return flat.astype(np.float32)


@dataclass(frozen=True)
class ActionDecoder:
    groups: tuple[ActionGroup, ...]
    gripper_flip: int | None = None  # column of LIBERO's scalar gripper

    @property
    def dim(self) -> int:
        return sum(g.dim for g in self.groups)

    def decode(self, norm: np.ndarray, raw_state: np.ndarray) -> np.ndarray:
        """norm (T, >= dim) model output, raw_state (S,) -> (T, dim) float32 actions."""
        parts = []
        for g in self.groups:
            a = g.unnormalize(norm[:, g.start : g.start + g.dim])
            if g.relative is not None:
                ref = raw_state[g.reference[0] : g.reference[1]]
                a = a + ref[None] if g.relative == "non_eef" else relative_eef_to_absolute(a, ref)
            parts.append(a)
        out = np.concatenate(parts, axis=-1).astype(np.float32)
        if self.gripper_flip is not None:
            out[:, self.gripper_flip] = -np.sign(2.0 * out[:, self.gripper_flip] - 1.0)
        return out


def _rows(values: Any, where: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float32)
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise CheckpointError(f"statistics.json: {where} must be a list or a list of per-step lists")
    return arr


def _relative_kind(cfg: dict[str, Any], where: str) -> str:
    # lerobot writes the enum values ("non_eef", "xyz+rot6d"), Isaac-GR00T's save_pretrained the enum
    # names ("NON_EEF", "XYZ_ROT6D")
    kind = str(cfg.get("type", "non_eef")).lower()
    fmt = str(cfg.get("format", "default")).lower().replace("xyz_rot6d", "xyz+rot6d")
    if kind == "non_eef":
        return "non_eef"
    if kind == "eef" and fmt == "xyz+rot6d":
        return "eef_xyz_rot6d"
    raise CheckpointError(
        f"processor_config.json: {where}: relative action type {kind!r} / format {fmt!r} "
        "is not supported (non_eef, or eef with xyz+rot6d)"
    )


def build_decoder(
    tag: str,
    stats: dict[str, Any],
    cfg: dict[str, Any],
    state_slices: dict[str, tuple[int, int]],
    percentiles: bool,
    relative_enabled: bool,
) -> ActionDecoder:
    """The decoder of embodiment ``tag`` from its statistics and its processor modality config."""
    action = cfg.get("action", {})
    keys, configs = list(action.get("modality_keys", [])), list(action.get("action_configs", []) or [])
    groups, start = [], 0
    for i, key in enumerate(keys):
        where = f"{tag}.action.{key}"
        entry = stats.get("action", {}).get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"statistics.json: {where} missing")
        c = configs[i] if i < len(configs) and isinstance(configs[i], dict) else {}
        relative = relative_enabled and str(c.get("rep", "absolute")).lower() == "relative"
        source = stats.get("relative_action", {}).get(key) if relative else entry
        lo_name, hi_name = ("q01", "q99") if percentiles and not relative else ("min", "max")
        if not isinstance(source, dict) or lo_name not in source or hi_name not in source:
            kind = "relative_action" if relative else "action"
            raise CheckpointError(f"statistics.json: {tag}.{kind}.{key} has no {lo_name}/{hi_name}")
        dim = _rows(entry.get("mean", entry.get(lo_name, entry.get("min"))), where).shape[-1]
        low, high = _rows(source[lo_name], where), _rows(source[hi_name], where)
        if low.shape[-1] != dim or high.shape != low.shape:
            raise CheckpointError(
                f"statistics.json: {where}: {lo_name}/{hi_name} shapes {low.shape}/{high.shape} "
                f"do not match the group's {dim} columns"
            )
        kind, reference = None, None
        if relative:
            kind = _relative_kind(c, where)
            state_key = str(c.get("state_key") or key)
            reference = state_slices.get(state_key)
            if reference is None or reference[1] - reference[0] != dim:
                raise CheckpointError(
                    f"processor_config.json: {where}: reference state {state_key!r} missing or not {dim} wide"
                )
        groups.append(ActionGroup(key, start, dim, low, high, kind, reference))
        start += dim
    flip = None
    if tag == "libero_sim":
        grip = [g for g in groups if g.key == "gripper"]
        if len(grip) != 1 or grip[0].dim != 1:
            raise CheckpointError("libero_sim: the LIBERO gripper transform needs one scalar 'gripper' group")
        flip = grip[0].start
    return ActionDecoder(tuple(groups), flip)
