"""flashrt.nn.qwen3vl vs transformers 5.5's Qwen3-VL (tests/fixtures/gen/gen_qwen3vl_blocks.py): the vision
tower on a non-square 4 x 6 patch grid (interpolated position grid, 2-D RoPE, merger, deepstack) and
Qwen3 text layers under M-RoPE positions of a text / image / text layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flashrt.frontends.groot.common.weights import LM, VIS, text_rules, vision_rules
from flashrt.io import Checkpoint, WeightMap, load_module
from flashrt.nn.qwen3vl import VisionTower, mrope_cos_sin, qwen3_layer

FIX = load_file(
    str(Path(__file__).resolve().parents[1] / "fixtures" / "groot" / "qwen3vl_blocks.safetensors")
)


def _checkpoint(prefix: str, new_prefix: str) -> Checkpoint:
    return Checkpoint.from_tensors(
        {new_prefix + k[len(prefix) :]: v for k, v in FIX.items() if k.startswith(prefix)}
    )


class _Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = VisionTower(32, 3, 64, 2, 16, 2, 2, 36, 48, (0, 2))


class _Text(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 48)
        self.layers = nn.ModuleList(qwen3_layer(48, 96, 4, 2, 12) for _ in range(2))


def test_vision_tower_matches_transformers(one_thread):
    model = load_module(_Vision, _checkpoint("vision.sd/", VIS), WeightMap(vision_rules())).vision
    with torch.inference_mode():
        merged, deep = model(FIX["vision.images"], model.tables(4, 6))
    assert (merged.reshape(-1, 48) - FIX["vision.merged"]).abs().max().item() <= 1e-5
    for i, d in enumerate(deep):
        assert (d.reshape(-1, 48) - FIX[f"vision.deepstack.{i}"]).abs().max().item() <= 1e-5


def test_text_layers_match_transformers_under_mrope(one_thread):
    wmap = WeightMap(text_rules(), ignore=[LM + "norm.weight"])
    model = load_module(_Text, _checkpoint("text.sd/", LM), wmap)
    cos, sin = mrope_cos_sin(FIX["text.positions"], 12, 1e4, (2, 2, 2))
    h = FIX["text.embeds"]
    with torch.inference_mode():
        for layer in model.layers:
            h = layer.forward(h, (cos, sin))
    assert (h - FIX["text.hidden"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("section", [(2, 2, 2), (4, 1, 1)])
def test_mrope_equals_1d_rope_when_rows_agree(section):
    """Equal temporal/height/width rows reduce M-RoPE to ordinary RoPE (what a text-only prompt gets)."""
    from flashrt.nn.rope import rope_cos_sin

    pos = torch.arange(7)
    cos, sin = mrope_cos_sin(pos.expand(3, -1), 12, 1e4, section)
    ref_cos, ref_sin = rope_cos_sin(pos[None], 12, 1e4)
    assert torch.allclose(cos, ref_cos) and torch.allclose(sin, ref_sin)
