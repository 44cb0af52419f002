"""flashrt.nn.siglip2 vs transformers 5.5's NaFlex Siglip2VisionModel (tests/fixtures/gen/
gen_siglip2_tower.py): non-square 6 x 8 patch grid from a 4 x 4 learned position grid."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from flashrt.io import Checkpoint, Rule, WeightMap, load_module, transforms
from flashrt.nn.siglip2 import Siglip2Vision

FIX = load_file(str(Path(__file__).resolve().parents[1] / "fixtures" / "groot" / "siglip2_tower.safetensors"))
SRC = "vision_model."


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = Siglip2Vision(32, 2, 64, 2, 8, 16)


def _map() -> WeightMap:
    enc, dst = SRC + "encoder.layers.{i}.", "vision.layers.{i}."
    rules = [
        Rule(SRC + "embeddings.patch_embedding.{p}", "vision.patch_embedding.{p}"),
        Rule(SRC + "embeddings.position_embedding.weight", "vision.position_embedding.weight"),
        Rule(SRC + "post_layernorm.{p}", "vision.post_norm.{p}"),
        Rule(enc + "self_attn.out_proj.{p}", dst + "o.{p}"),
        Rule(tuple(enc + f"self_attn.{n}_proj.{{p}}" for n in "qkv"), dst + "qkv.{p}", transforms.concat(0)),
    ]
    rules += [
        Rule(enc + f"{s}.{{p}}", dst + f"{d}.{{p}}")
        for s, d in (
            ("layer_norm1", "norm1"),
            ("layer_norm2", "norm2"),
            ("mlp.fc1", "fc1"),
            ("mlp.fc2", "fc2"),
        )
    ]
    return WeightMap(rules)


def test_siglip2_tower_matches_transformers(one_thread):
    sd = Checkpoint.from_tensors({k[3:]: v for k, v in FIX.items() if k.startswith("sd/")})
    tower = load_module(_Tower, sd, _map()).vision
    with torch.inference_mode():
        out = tower(FIX["images"], tower.position_table(6, 8))
    assert (out - FIX["hidden"]).abs().max().item() <= 1e-5
