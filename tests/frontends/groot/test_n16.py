"""GR00T N1.6 (Isaac-GR00T layout) vs Isaac-GR00T's own N1.6 code (tests/fixtures/gen/gen_groot_n16.py):
the Eagle 3 VL backbone features (``EagleBackbone.forward``) and the actions (``Gr00tN1d6.get_action``)
from the processor's own tensors; the checkpoint folder's config reading and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError
from flashrt.frontends.groot import n16
from flashrt.io import open_checkpoint

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "groot"
CK = FIX / "n16_tiny"
IO = load_file(str(FIX / "n16_io.safetensors"))
CASES = ("one_cam", "two_cams")


@pytest.fixture(scope="module")
def model(one_thread):
    config, _ = n16.n16_config(CK, json.loads((CK / "config.json").read_text()))
    with open_checkpoint(CK / "model.safetensors") as weights:
        return n16.load_n16(config, weights)


def _run(model, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (L, W), normalized actions (T, A)) from the processor's input_ids / pixel_values."""
    e = model.config.eagle
    ids, px = IO[f"{case}/input_ids"][None], IO[f"{case}/pixel_values"]
    tables = model.tables(ids.shape[1], tuple(px.shape[-2:]))
    slots = (ids[0] == e.image_token).nonzero()[:, 0]
    keys = (ids == e.image_token)[:, None, None, :]
    out = torch.zeros(1, *IO[f"{case}/noise"].shape)
    with torch.inference_mode():
        vision = model.backbone.vision_tokens(px, tables["positions"]).reshape(1, -1, e.text_width)
        features = model.backbone(vision, ids, slots, tables["cos"], tables["sin"])
        model.head.sample(
            features,
            torch.ones_like(ids, dtype=torch.bool),
            keys,
            IO[f"{case}/state_norm"][None],
            IO[f"{case}/noise"][None],
            out,
            tables["steps"],
            int(IO[f"{case}/embodiment_id"][0]),
        )
    return features[0], out[0]


@pytest.mark.parametrize("case", CASES)
def test_backbone_and_actions_match_isaac_gr00t(model, case):
    features, actions = _run(model, case)
    assert (features - IO[f"{case}/backbone_features"]).abs().max().item() <= 1e-5
    assert (actions - IO[f"{case}/actions_norm"]).abs().max().item() <= 1e-5


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "n16"
    shutil.copytree(CK, folder)
    return folder


@pytest.mark.parametrize("flag", ["use_windows_attn", "use_rope"])
def test_refuses_windowed_or_rope_siglip2(tmp_path, flag):
    folder = _copy(tmp_path)
    bb = json.loads((folder / "backbone" / "config.json").read_text())
    bb["vision_config"][flag] = True
    (folder / "backbone" / "config.json").write_text(json.dumps(bb))
    with pytest.raises(CheckpointError, match=flag):
        n16.n16_config(folder, json.loads((folder / "config.json").read_text()))


def test_published_backbone_name_reads_the_builtin_config():
    g = {**json.loads((CK / "config.json").read_text()), "model_name": n16.EAGLE3_NAME, "select_layer": 16}
    g["backbone_embedding_dim"] = 2048
    config, bb_dir = n16.n16_config(CK, g)
    assert bb_dir is None
    assert (config.eagle.text_width, config.eagle.layers, config.eagle.image_token) == (2048, 16, 151669)
