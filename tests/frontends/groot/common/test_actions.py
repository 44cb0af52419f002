"""GR00T action decoding, hand-checked cases (the lerobot comparison is the ``relative`` case of
n17/test_frontend.py)."""

from __future__ import annotations

import numpy as np
import pytest

from flashrt.errors import CheckpointError
from flashrt.frontends.groot.common.actions import (
    ActionDecoder,
    ActionGroup,
    build_decoder,
    relative_eef_to_absolute,
)

IDENTITY6 = [1, 0, 0, 0, 1, 0]


def test_relative_pose_composes_rotation_then_translation():
    """Reference: 90 degrees about z at (1, 2, 3). A relative step of (1, 0, 0) moves along the rotated x
    axis, i.e. world +y; the orientation composes."""
    rz90 = [0, -1, 0, 1, 0, 0]  # the first two rows of Rz(90) = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]
    ref = np.array([1, 2, 3, *rz90], np.float32)
    rel = np.array([[1, 0, 0, *IDENTITY6], [0, 0, 0, *rz90]], np.float32)
    out = relative_eef_to_absolute(rel, ref)
    np.testing.assert_allclose(out[0], [1, 3, 3, *rz90], atol=1e-6)
    np.testing.assert_allclose(out[1], [1, 2, 3, -1, 0, 0, 0, -1, 0], atol=1e-6)  # Rz(180)


def test_groups_per_step_stats_non_eef_and_libero_gripper():
    lo, hi = np.zeros((3, 2), np.float32), np.ones((3, 2), np.float32) * np.array([[1], [2], [3]], np.float32)
    dec = ActionDecoder(
        (
            ActionGroup("joints", 0, 2, lo, hi, "non_eef", (1, 3)),
            ActionGroup("gripper", 2, 1, np.zeros(1, np.float32), np.ones(1, np.float32)),
        ),
        2,
    )
    norm = np.array([[1, -1, 1], [0, 0, -1]], np.float32)  # 2 steps: per-step rows 0 and 1
    out = dec.decode(norm, np.array([9, 10, 20], np.float32))
    np.testing.assert_allclose(out, [[11, 20, -1], [11, 21, 1]])


def test_unsupported_relative_type_is_refused():
    stats = {
        "action": {"a": {"min": [0.0], "max": [1.0]}},
        "relative_action": {"a": {"min": [0.0], "max": [1.0]}},
    }
    cfg = {
        "action": {
            "modality_keys": ["a"],
            "action_configs": [{"rep": "relative", "type": "eef", "format": "quat"}],
        }
    }
    with pytest.raises(CheckpointError, match="quat"):
        build_decoder("t", stats, cfg, {"a": (0, 1)}, percentiles=False, relative_enabled=True)


def test_isaac_gr00t_enum_names_read_as_lerobot_values():
    """Isaac-GR00T's save_pretrained writes ActionConfig enums by name (RELATIVE, EEF, XYZ_ROT6D); lerobot
    by value (relative, eef, xyz+rot6d): both decode the same."""
    stats = {
        "action": {"pose": {"min": [0.0] * 9, "max": [1.0] * 9}},
        "relative_action": {"pose": {"min": [-1.0] * 9, "max": [1.0] * 9}},
    }
    slices = {"pose": (0, 9)}
    by_value = {"rep": "relative", "type": "eef", "format": "xyz+rot6d"}
    by_name = {"rep": "RELATIVE", "type": "EEF", "format": "XYZ_ROT6D"}
    decs = [
        build_decoder("t", stats, {"action": {"modality_keys": ["pose"], "action_configs": [c]}}, slices,
                      False, True)
        for c in (by_value, by_name)
    ]
    assert [g.relative for d in decs for g in d.groups] == ["eef_xyz_rot6d"] * 2
    norm = np.linspace(-0.5, 0.5, 18, dtype=np.float32).reshape(2, 9)
    ref = np.array([1, 2, 3, *IDENTITY6], np.float32)
    np.testing.assert_array_equal(decs[0].decode(norm, ref), decs[1].decode(norm, ref))
