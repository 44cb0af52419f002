"""Checkpoint detection and reading: lerobot 0.6.1 policy dirs, openpi PyTorch dirs, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import pi0_e2e

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.checkpoint import (
    OPENPI_CAMERAS,
    detect_layout,
    load_checkpoint,
    relative_offset,
)

E2E = pi0_e2e


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name", E2E.CASES)
def test_lerobot_dirs(name):
    case = E2E.case(name)
    assert detect_layout(case.policy_dir) == "lerobot"
    ck = load_checkpoint(case.policy_dir, tokenizer=E2E.TOKENIZER)
    info = case.info
    assert (ck.layout, ck.variant) == ("lerobot", info["kind"])
    assert ck.cameras == tuple(info["cameras"])
    assert (ck.resolution, ck.state_dim) == (info["resolution"], info["state_dim"])
    assert ck.action_dim == info["action_dim"]
    c = ck.model_config
    assert (c.chunk_size, c.num_steps) == (info["chunk_size"], info["num_steps"])
    assert c.max_action_dim == info["max_dim"]
    assert (ck.n_action_steps, ck.max_prompt_len) == (info["n_action_steps"], info["tokenizer_max_length"])
    assert ck.prompt_format == ("pi05" if info["kind"] == "pi05" else "lerobot_pi0")
    assert (ck.relative_mask is not None) == name.endswith("_rel") and dict(ck.rename_map) == {}
    assert ck.summary()["normalization"]["state"] == ("QUANTILES" if info["kind"] == "pi05" else "MEAN_STD")


@pytest.mark.parametrize("name", ["pi0_cam1", "pi05_cam2"])
def test_openpi_dirs(tmp_path, name):
    case = E2E.case(name)
    folder = E2E.to_openpi(case, tmp_path / "openpi")
    assert detect_layout(folder) == "openpi"
    ck = load_checkpoint(folder, tokenizer=E2E.TOKENIZER)
    assert (ck.layout, ck.variant, ck.cameras) == ("openpi", case.info["kind"], OPENPI_CAMERAS)
    assert (ck.state_dim, ck.action_dim) == (case.info["state_dim"], case.info["action_dim"])
    assert ck.model_config.chunk_size == case.info["chunk_size"]
    assert ck.model_config.num_steps == 10 and ck.n_action_steps == case.info["chunk_size"]
    assert ck.prompt_format == ("pi05" if case.info["kind"] == "pi05" else "openpi_pi0")
    assert ck.max_prompt_len == (200 if case.info["kind"] == "pi05" else 48)
    assert (ck.state_norm.convention, ck.state_norm.eps) == ("openpi", 1e-6)


def test_openpi_asset_choice(tmp_path):
    folder = E2E.to_openpi(E2E.case("pi0_cam1"), tmp_path / "openpi", asset_id="a")
    E2E.to_openpi(E2E.case("pi0_cam1"), folder, asset_id="b")
    with pytest.raises(CheckpointError, match="several norm_stats.json.*asset_id"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER)
    assert load_checkpoint(folder, tokenizer=E2E.TOKENIZER, asset_id="b").layout == "openpi"
    with pytest.raises(CheckpointError, match="asset ids here"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER, asset_id="c")
    _edit_json(folder / "config.json", lambda d: d.update(action_dim=7))
    with pytest.raises(CheckpointError, match="action_dim 7 differs"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER, asset_id="a")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        detect_layout(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="neither a lerobot policy dir.*notes.txt"):
        load_checkpoint(tmp_path)


def test_old_lerobot_dir_without_processors(tmp_path):
    folder = E2E.copy_policy(E2E.case("pi0_cam1"), tmp_path / "policy")
    (folder / "policy_preprocessor.json").unlink()
    with pytest.raises(CheckpointError, match="migrate_policy_normalization"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER)


def test_missing_tokenizer(tmp_path):
    folder = E2E.copy_policy(E2E.case("pi0_cam1"), tmp_path / "policy")
    with pytest.raises(CheckpointError, match="google/paligemma-3b-pt-224"):
        load_checkpoint(folder)
    (folder / "tokenizer.model").write_bytes(E2E.TOKENIZER.read_bytes())
    assert load_checkpoint(folder).tokenizer_path == folder / "tokenizer.model"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(type="act"), "'act' policy, not pi0"),
        (lambda d: d.update(image_resolution=[56, 56]), "image_resolution"),
        (lambda d: d.update(max_action_dim=32), "max_action_dim 32 differs"),
        (lambda d: d["input_features"].pop("observation.state"), "no 'observation.state' feature"),
    ],
)
def test_inconsistent_config(tmp_path, edit, match):
    folder = E2E.copy_policy(E2E.case("pi0_cam2"), tmp_path / "policy")
    _edit_json(folder / "config.json", edit)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER)


def test_unknown_processor_step_is_refused(tmp_path):
    folder = E2E.copy_policy(E2E.case("pi05_cam1"), tmp_path / "policy")
    _edit_json(folder / "policy_preprocessor.json",
               lambda d: d["steps"].append({"registry_name": "image_crop_processor", "config": {}}))
    with pytest.raises(CheckpointError, match="image_crop_processor.*refusing"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER)


def test_renames_empty_cameras_and_relative_actions(tmp_path):
    folder = E2E.copy_policy(E2E.case("pi0_cam1"), tmp_path / "policy")

    def pre(d):
        for step in d["steps"]:
            if step["registry_name"] == "rename_observations_processor":
                step["config"]["rename_map"] = {"observation.images.front": "observation.images.top"}
            if step["registry_name"] == "relative_actions_processor":
                step["config"].update(enabled=True, exclude_joints=["gripper"],
                                      action_names=["j0", "j1", "j2", "j3", "Gripper_pos"])

    _edit_json(folder / "policy_preprocessor.json", pre)
    _edit_json(folder / "config.json", lambda d: d.update(empty_cameras=1))
    ck = load_checkpoint(folder, tokenizer=E2E.TOKENIZER)
    assert ck.cameras == ("top", "empty_camera_0")
    assert dict(ck.rename_map) == {"observation.images.front": "observation.images.top"}
    assert ck.relative_mask == (True, True, True, True, False)
    offset = relative_offset(ck.relative_mask, torch.arange(6.0), ck.action_dim)
    assert offset.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0]
