"""Pi0 checkpoints with a hostile file in every place one is read (config, processor JSONs, statistics,
weights, tokenizer, openpi norm stats) or a path that leads out of the folder: a typed error, under a
memory limit and a timeout (flashrt.testing.hostile), never a hang or unbounded memory."""

from __future__ import annotations

import json

import pytest
from support import pi0_e2e as E2E

from flashrt.errors import CheckpointError, FlashRTError
from flashrt.frontends.pi0.checkpoint import load_checkpoint
from flashrt.testing.hostile import bounded_call, make_hostile

pytestmark = pytest.mark.timeout(180)
KINDS = ("dev-zero", "fifo", "directory")


def _lerobot(tmp_path):
    return E2E.copy_policy(E2E.case("pi0_cam1"), tmp_path / "policy")


def _state_file(folder, pipeline="policy_preprocessor"):
    (path,) = folder.glob(f"{pipeline}_step_*_*.safetensors")
    return path


LEROBOT_PLACES = {
    "config.json": lambda d: d / "config.json",
    "policy_preprocessor.json": lambda d: d / "policy_preprocessor.json",
    "policy_postprocessor.json": lambda d: d / "policy_postprocessor.json",
    "model.safetensors": lambda d: d / "model.safetensors",
    "normalizer state file": _state_file,
    "unnormalizer state file": lambda d: _state_file(d, "policy_postprocessor"),
    "tokenizer.model": lambda d: d / "tokenizer.model",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("place", LEROBOT_PLACES)
def test_hostile_file_in_a_lerobot_dir(tmp_path, place, kind):
    folder = _lerobot(tmp_path)
    path = LEROBOT_PLACES[place](folder)
    path.unlink(missing_ok=True)
    make_hostile(path, kind)
    tokenizer = None if place == "tokenizer.model" else E2E.TOKENIZER

    def load():
        ckpt = load_checkpoint(folder, tokenizer=tokenizer)
        from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer

        PaliGemmaTokenizer(ckpt.tokenizer_path)  # the tokenizer is read when the policy is built

    exc = bounded_call(load, timeout_s=20.0, fifos=[path])
    assert isinstance(exc, FlashRTError), repr(exc)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("place", ["norm_stats.json", "config.json"])
def test_hostile_file_in_an_openpi_dir(tmp_path, place, kind):
    folder = E2E.to_openpi(E2E.case("pi0_cam1"), tmp_path / "openpi")
    path = folder / "assets" / "robot" / "norm_stats.json" if place == "norm_stats.json" else folder / place
    path.unlink()
    make_hostile(path, kind)
    exc = bounded_call(lambda: load_checkpoint(folder, tokenizer=E2E.TOKENIZER, asset_id="robot"),
                       timeout_s=20.0, fifos=[path])
    if place == "config.json" and exc is None:  # optional in openpi dirs: a non-file is skipped, not read
        return
    assert isinstance(exc, FlashRTError), repr(exc)


ESCAPES = {"absolute": "{outside}/stats.safetensors", "parent": "../outside/stats.safetensors",
           "symlink out": "link/stats.safetensors", "not a string": 5}


@pytest.mark.parametrize("case", ESCAPES)
def test_state_file_stays_inside_the_folder(tmp_path, case):
    folder = _lerobot(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    state = _state_file(folder)
    (outside / "stats.safetensors").write_bytes(state.read_bytes())
    (folder / "link").symlink_to(outside)
    name = ESCAPES[case]
    name = name.format(outside=outside) if isinstance(name, str) else name
    pre = json.loads((folder / "policy_preprocessor.json").read_text())
    for step in pre["steps"]:
        if step.get("state_file") == state.name:
            step["state_file"] = name
    (folder / "policy_preprocessor.json").write_text(json.dumps(pre))
    with pytest.raises(CheckpointError, match="state_file"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER)


@pytest.mark.parametrize("asset_id", ["../outside", "/tmp", "link", "robot/../../outside"])
def test_asset_id_stays_inside_the_folder(tmp_path, asset_id):
    folder = E2E.to_openpi(E2E.case("pi0_cam1"), tmp_path / "openpi")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "norm_stats.json").write_bytes((folder / "assets" / "robot" / "norm_stats.json").read_bytes())
    (folder / "assets" / "link").symlink_to(outside)
    with pytest.raises(CheckpointError, match="asset_id"):
        load_checkpoint(folder, tokenizer=E2E.TOKENIZER, asset_id=asset_id)


def _as_hub_snapshot(folder, root):
    """The files of `folder` laid out as huggingface_hub caches them: each a link into blobs."""
    import os

    repo = root / "models--o--n"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    for i, src in enumerate(sorted(p for p in folder.rglob("*") if p.is_file())):
        blob = blobs / f"{i:064x}"
        blob.write_bytes(src.read_bytes())
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_lerobot_dir_in_a_hub_cache_loads(tmp_path):
    snapshot = _as_hub_snapshot(_lerobot(tmp_path), tmp_path / "hub")
    assert load_checkpoint(snapshot, tokenizer=E2E.TOKENIZER).layout == "lerobot"


def test_openpi_dir_in_a_hub_cache_loads(tmp_path):
    folder = E2E.to_openpi(E2E.case("pi0_cam1"), tmp_path / "openpi")
    snapshot = _as_hub_snapshot(folder, tmp_path / "hub")
    assert load_checkpoint(snapshot, tokenizer=E2E.TOKENIZER, asset_id="robot").layout == "openpi"
