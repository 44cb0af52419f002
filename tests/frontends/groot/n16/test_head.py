"""GR00T N1.6 action head = lerobot 0.6.1's N1.7 head without VL self-attention (tests/fixtures/gen/
gen_groot_n16_head.py): flashrt's `ActionHead` with ``vl_layers=0``, strict weight map, <= 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flashrt.frontends.groot.common.config import head_config
from flashrt.frontends.groot.common.head import ActionHead
from flashrt.frontends.groot.common.weights import head_rules
from flashrt.io import Checkpoint, WeightMap, load_module

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
IO = load_file(str(FIX / "n16_head.safetensors"))


class _HeadOnly(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.head = ActionHead(config)


@pytest.fixture(scope="module")
def head(one_thread):
    g = json.loads((FIX / "n17_tiny" / "config.json").read_text())
    g["vl_self_attention_cfg"] = {**g["vl_self_attention_cfg"], "num_layers": 0}
    config = head_config(g, "n17_tiny/config.json (vl_self_attention off)")
    sd = Checkpoint.from_tensors({k[3:]: v for k, v in IO.items() if k.startswith("sd/")})
    return load_module(lambda: _HeadOnly(config), sd, WeightMap(head_rules())).head


@pytest.mark.parametrize("case", ["short", "padded"])
def test_head_matches_lerobot_without_vl_self_attention(head, case):
    out = torch.zeros(1, *IO[f"{case}/noise"].shape)
    image_keys = IO[f"{case}/image_mask"][None, None, None, :]
    with torch.inference_mode():
        head.sample(
            IO[f"{case}/features"],
            IO[f"{case}/attention_mask"][None],
            image_keys,
            IO[f"{case}/state"],
            IO[f"{case}/noise"][None],
            out,
            head.step_tables(head.config.num_steps),
            int(IO[f"{case}/embodiment_id"][0]),
        )
    assert (out[0] - IO[f"{case}/action_pred"]).abs().max().item() <= 1e-5
